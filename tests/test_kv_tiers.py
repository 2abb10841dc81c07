"""KV tiers below the device cache: payload codec, cpu, disk and s3 tiers, the tier manager.

Real parts throughout: real files under tmp_path (tmpfs mounts for a full and a read-only disk,
where the box allows mounting), a real S3 server (SeaweedFS `weed mini`, tests/s3_fixtures.py),
a real stuck socket for timeouts. No mocks, except the full-disk case on a box without mount.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from s3_fixtures import BUCKET, free_port, hanging_endpoint
from tierserve.engine.core.block_hash import extend_hashes, fingerprint
from tierserve.engine.kv_tiers import codec
from tierserve.engine.kv_tiers.breaker import BreakerState, CircuitBreaker
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.kv_tiers.errors import CorruptPayload, TierError
from tierserve.engine.kv_tiers.layout import BlockLayout
from tierserve.engine.kv_tiers.manager import TierManager
from tierserve.engine.kv_tiers.registry import create_tier, tier_class

SMALL = (2, 2, 1, 4, 8)  # [layers, 2, kv_heads, block_size, head_dim]: 512 bytes in fp32
EMBEDDED = (30, 2, 3, 16, 64)  # the embedded model: 737,280 bytes in fp32
FP = fingerprint("test-model", "fp32")


def chain(n: int, seed: int = 0, extra: bytes = FP) -> list:
    keys: list = []
    extend_hashes(keys, [seed * 1000 + t for t in range(4 * n)], 4, extra)
    return keys


def blocks(n: int, shape=SMALL, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def tier(name: str, tmp_path: Path, shape=SMALL, **cfg):
    cfg.setdefault("disk_dir", str(tmp_path))
    return create_tier(name, TierConfig(tiers=(name,), **cfg),
                       BlockLayout(FP, shape, torch.float32))


def payload_bytes(shape=SMALL) -> int:
    return len(codec.encode(chain(1), blocks(1, shape)))


def wait_until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def disk_files(root: Path, pattern: str = "*.safetensors") -> list[Path]:
    return sorted(root.rglob(pattern))


# ---- vocabulary, config, registry ----------------------------------------------------------

def test_config_and_registry_import_no_torch(tmp_path):
    """Tier settings can be parsed and validated without pulling torch or boto3 in."""
    code = ("import sys\n"
            "from tierserve.engine.kv_tiers import TierConfig, Medium\n"
            "TierConfig(tiers=('cpu', 'disk'), disk_dir='/x')\n"
            "bad = [m for m in ('torch', 'boto3') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_unknown_tier_names_list_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="valid: cpu, disk, s3"):
        TierConfig(tiers=("cpu", "nvme"))
    with pytest.raises(ValueError, match="valid: cpu, disk, s3"):
        tier_class("tape")
    with pytest.raises(ValueError, match="disk_dir"):
        TierConfig(tiers=("disk",))
    with TierManager(TierConfig(), FP, SMALL, torch.float32) as mgr:
        with pytest.raises(ValueError, match="valid: cpu, disk, s3"):
            mgr.lookup(chain(1), load_tiers=("gpu",))


def test_tiers_speak_vllm_media_vocabulary(tmp_path):
    got = {n: (tier_class(n).medium.value, tier_class(n).locality.value)
           for n in ("cpu", "disk", "s3")}
    assert got == {"cpu": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"),
                   "s3": ("STORAGE", "REMOTE")}


# ---- codec ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_codec_round_trip_is_bit_exact(dtype):
    x = blocks(3, dtype=dtype)
    x[0, 0, 0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    keys = chain(3)
    y = codec.decode(codec.encode(keys, x), keys, dtype, SMALL)
    assert same_bits(x, y)


def test_codec_payload_of_an_embedded_model_block_is_its_kv_plus_a_small_header():
    x = blocks(1, EMBEDDED)
    data = codec.encode(chain(1), x)
    assert 737_280 < len(data) < 737_280 + 1024
    assert same_bits(codec.decode(data, chain(1), torch.float32, EMBEDDED), x)


def test_codec_rejects_payloads_of_other_keys_dtypes_or_shapes():
    keys, x = chain(2), blocks(2)
    data = codec.encode(keys, x)
    for args in [(keys[::-1], torch.float32, SMALL), (chain(2, seed=1), torch.float32, SMALL),
                 (keys[:1], torch.float32, SMALL), (keys, torch.float16, SMALL),
                 (keys, torch.float32, (2, 2, 1, 8, 4))]:
        with pytest.raises(CorruptPayload):
            codec.decode(data, *args)


def test_codec_detects_flipped_truncated_and_garbage_bytes():
    keys = chain(1)
    data = codec.encode(keys, blocks(1))
    flipped = bytearray(data)
    flipped[-7] ^= 0x01  # one bit of the tensor data
    for bad in [bytes(flipped), data[:-1], data[:len(data) // 2], data[:7], b"",
                os.urandom(len(data)), data + b"x"]:
        with pytest.raises(CorruptPayload):
            codec.decode(bad, keys, torch.float32, SMALL)


# ---- cpu tier ------------------------------------------------------------------------------

def test_cpu_tier_evicts_least_recently_used_first_suffix_before_prefix(tmp_path):
    """The stated order: LRU; a store or load touches its keys last-to-first."""
    t = tier("cpu", tmp_path, cpu_bytes=3 * 512)
    a, b, c = chain(2, seed=1), chain(1, seed=2), chain(1, seed=3)
    t.store(a, list(blocks(2)))
    t.store(b, list(blocks(1)))
    assert t.keys() == [a[1], a[0], b[0]]  # next victim first: a's suffix, then its prefix
    t.load([a[1]])
    assert t.keys() == [a[0], b[0], a[1]]
    t.store(c, list(blocks(1)))
    assert t.keys() == [b[0], a[1], c[0]]
    assert t.used_bytes == 3 * 512 and t.stats().evictions == 1
    assert t.contains_prefix(a) == 0


def test_cpu_tier_keeps_its_own_contiguous_copy(tmp_path):
    t = tier("cpu", tmp_path)
    src = blocks(1)[0].transpose(-1, -2).contiguous().transpose(-1, -2)  # a strided view
    keep = src.clone()
    t.store(chain(1), [src])
    src.fill_(7)
    (got,) = t.load(chain(1))
    assert got.is_contiguous() and same_bits(got, keep)


# ---- disk tier -----------------------------------------------------------------------------

def test_disk_tier_writes_one_content_addressed_file_per_block(tmp_path):
    t = tier("disk", tmp_path)
    keys, x = chain(3), blocks(3)
    assert t.store(keys, list(x)) == 3
    files = disk_files(tmp_path)
    assert files == sorted(tmp_path / FP.hex() / k.hex()[:2] / f"{k.hex()}.safetensors"
                           for k in keys)
    assert not disk_files(tmp_path, "*.tmp")
    assert t.used_bytes == sum(f.stat().st_size for f in files)
    assert all(same_bits(g, w) for g, w in zip(t.load(keys), x))


def test_disk_writer_killed_mid_write_leaves_only_a_temp_file_that_is_never_read(tmp_path):
    """A real crash: the child process dies between writing the temp file and the rename."""
    code = ("import os, torch\n"
            "from tierserve.engine.kv_tiers.config import TierConfig\n"
            "from tierserve.engine.kv_tiers.layout import BlockLayout\n"
            "from tierserve.engine.kv_tiers.disk import DiskTier\n"
            f"t = DiskTier(TierConfig(tiers=('disk',), disk_dir={str(tmp_path)!r}),\n"
            f"             BlockLayout({FP!r}, {SMALL!r}, torch.float32))\n"
            "os.replace = lambda *a: os._exit(9)\n"
            f"t.store([bytes.fromhex({chain(1)[0].hex()!r})], [torch.ones({SMALL!r})])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 9, r.stderr
    (tmp,) = disk_files(tmp_path, "*.tmp")
    assert not disk_files(tmp_path)

    fresh = tier("disk", tmp_path)  # a young temp file may be a live writer's: left alone
    assert fresh.contains_prefix(chain(1)) == 0 and fresh.keys() == [] and tmp.exists()
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    restarted = tier("disk", tmp_path)
    assert not tmp.exists() and restarted.cleaned_tmp_files == 1
    assert restarted.contains_prefix(chain(1)) == 0


def test_disk_restart_rebuilds_the_index_in_the_same_lru_order(tmp_path):
    t = tier("disk", tmp_path)
    a, b = chain(3, seed=1), chain(2, seed=2)
    t.store(a, list(blocks(3)))
    t.store(b, list(blocks(2, seed=5)))
    t.load(a[:1])
    order = t.keys()
    assert order[-1] == a[0] and order[0] == a[2]

    again = tier("disk", tmp_path)
    assert again.keys() == order
    assert again.used_bytes == t.used_bytes
    assert again.contains_prefix(b) == 2
    assert all(same_bits(g, w) for g, w in zip(again.load(b), blocks(2, seed=5)))


def test_disk_evicts_least_recently_used_files_first_under_capacity(tmp_path):
    size = payload_bytes()
    t = tier("disk", tmp_path, disk_bytes=3 * size)
    a, b, c = chain(2, seed=1), chain(1, seed=2), chain(2, seed=3)
    t.store(a, list(blocks(2)))
    t.store(b, list(blocks(1)))
    t.load([a[1]])
    assert t.keys() == [a[0], b[0], a[1]]
    t.store(c, list(blocks(2)))  # two victims: a[0], then b[0]
    assert t.keys() == [a[1], c[1], c[0]]
    assert {f.stem for f in disk_files(tmp_path)} == {k.hex() for k in t.keys()}
    assert t.used_bytes == 3 * size and t.stats().evictions == 2
    assert tier("disk", tmp_path, disk_bytes=2 * size).keys() == [c[1], c[0]]  # shrunk


def test_disk_corrupt_and_truncated_files_are_misses_and_are_deleted(tmp_path):
    keys, x = chain(4), blocks(4)
    with TierManager(TierConfig(tiers=("disk",), disk_dir=str(tmp_path)), FP, SMALL,
                     torch.float32) as mgr:
        mgr.store(keys, x)
        assert mgr.flush(10)
        disk = mgr.tiers["disk"]
        flipped = bytearray(Path(disk.path(keys[2])).read_bytes())
        flipped[-3] ^= 0x10
        Path(disk.path(keys[2])).write_bytes(bytes(flipped))
        got = mgr.start_load(mgr.lookup(keys)).result(timeout=10)
        assert len(got) == 2 and all(same_bits(g, w) for g, w in zip(got, x))

        data = Path(disk.path(keys[3])).read_bytes()
        Path(disk.path(keys[3])).write_bytes(data[:len(data) // 3])
        with pytest.raises(CorruptPayload):
            disk.load([keys[3]])
        assert not Path(disk.path(keys[2])).exists() and not Path(disk.path(keys[3])).exists()
        assert mgr.lookup(keys).num_blocks == 2
        assert disk.stats().errors["corrupt"] == 2


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A real tmpfs of `size` at path; yields False where this box cannot mount."""
    path.mkdir()
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True).returncode == 0
    except FileNotFoundError:
        ok = False
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_disk_fails_stores_cleanly_backs_off_and_keeps_serving_loads(tmp_path, monkeypatch):
    keys, x = chain(3), blocks(3, EMBEDDED)  # 737 KB payloads: two fit in a 2 MiB tmpfs
    with tmpfs(tmp_path / "small", "2m") as mounted:
        t = tier("disk", tmp_path / "small", EMBEDDED, disk_error_backoff_s=0.3)
        assert t.store(keys[:2], list(x[:2])) == 2
        if not mounted:  # no mount here: the one simulated failure of this file
            def full(fd):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(os, "fsync", full)
        assert t.store(keys[2:], list(x[2:])) == 0
        assert t.stats().errors == {"no_space": 1} and t.breaker_state == "open"
        assert not disk_files(tmp_path, "*.tmp")
        assert t.store(keys[2:], list(x[2:])) == 0  # backing off: not even tried
        assert t.stats().errors == {"no_space": 1, "unavailable": 1}
        assert all(same_bits(g, w) for g, w in zip(t.load(keys[:2]), x[:2]))

        monkeypatch.undo()
        t.remove(keys[1])  # room for one payload again
        time.sleep(0.35)  # the back-off: the next store is the probe
        assert t.store(keys[2:], list(x[2:])) == 1 and t.breaker_state == "closed"
        assert same_bits(t.load(keys[2:])[0], x[2])


def test_read_only_disk_fails_stores_cleanly_and_keeps_serving_loads(tmp_path):
    root = tmp_path / "ro"
    keys, x = chain(2), blocks(2)
    with tmpfs(root, "1m") as mounted:
        if not mounted and os.geteuid() == 0:
            pytest.skip("cannot mount here, and as root chmod does not stop writes")
        t = tier("disk", root)
        assert t.store(keys[:1], list(x[:1])) == 1
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        else:
            for d in [root, *root.rglob("*")]:
                if d.is_dir():
                    d.chmod(0o500)
        assert t.store(keys[1:], list(x[1:])) == 0
        assert t.stats().errors == {"read_only": 1} and t.breaker_state == "open"
        assert same_bits(t.load(keys[:1])[0], x[0])

        restarted = tier("disk", root)  # starting on a read-only disk works too
        assert restarted.contains_prefix(keys) == 1
        assert same_bits(restarted.load(keys[:1])[0], x[0])
        assert restarted.store(keys[1:], list(x[1:])) == 0
        assert restarted.stats().errors.get("read_only", 0) >= 1


# ---- circuit breaker -----------------------------------------------------------------------

def test_breaker_opens_probes_once_and_backs_off_longer_after_a_failed_probe():
    now = [0.0]
    br = CircuitBreaker(threshold=2, backoff_s=1.0, max_backoff_s=3.0, clock=lambda: now[0])
    br.record_failure()
    assert br.allow() and br.state is BreakerState.CLOSED
    br.record_failure()
    assert br.state is BreakerState.OPEN and not br.allow()
    now[0] = 1.0
    assert br.allow() and not br.allow()  # one probe only
    br.record_failure()  # probe failed: back-off 2 s
    now[0] = 2.9
    assert not br.allow()
    now[0] = 3.0
    assert br.allow()
    br.record_failure()  # back-off capped at 3 s
    now[0] = 5.9
    assert not br.allow()
    now[0] = 6.0
    assert br.allow()
    br.record_success()
    assert br.state is BreakerState.CLOSED and br.allow() and br.opened == 3


# ---- s3 tier -------------------------------------------------------------------------------

@pytest.fixture
def s3(weed, s3_creds):
    if weed.proc is None or weed.proc.poll() is not None:
        weed.start()  # an earlier test left it stopped
    return weed


def s3_config(endpoint: str, **kw) -> TierConfig:
    kw = {"s3_bucket": BUCKET, "s3_prefix": f"t-{uuid.uuid4().hex[:8]}",
          "s3_endpoint_url": endpoint, "s3_region": "us-east-1", "s3_connect_timeout_s": 0.5,
          "s3_read_timeout_s": 0.5, "s3_max_attempts": 1, "breaker_threshold": 2,
          "breaker_backoff_s": 0.3, **kw}
    return TierConfig(tiers=("s3",), **kw)


def s3_tier(cfg: TierConfig, shape=SMALL, fp: bytes = FP):
    return create_tier("s3", cfg, BlockLayout(fp, shape, torch.float32))


def test_s3_round_trip_against_a_real_server(s3):
    cfg = s3_config(s3.endpoint_url, s3_read_timeout_s=5)
    t = s3_tier(cfg, EMBEDDED)
    keys, x = chain(3), blocks(3, EMBEDDED)
    assert t.store(keys, list(x)) == 3
    assert t.store(keys, list(x)) == 0  # content-addressed: already there, not uploaded again
    assert sorted(t.keys()) == sorted(keys)
    assert t.contains_prefix(keys + chain(1, seed=9)) == 3
    assert all(same_bits(g, w) for g, w in zip(t.load(keys), x))
    st = t.stats()
    assert st.stored_blocks == 3 and st.loaded_blocks == 3 and st.breaker_state == "closed"
    assert st.used_bytes == st.bytes_stored > 3 * 737_280

    raw = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1")
    obj = f"{cfg.s3_prefix}/{FP.hex()}/{keys[0].hex()}"
    assert raw.head_object(Bucket=BUCKET, Key=obj)["ContentLength"] == st.bytes_stored // 3
    other_model = s3_tier(cfg, EMBEDDED, fingerprint("another-model"))
    assert other_model.contains_prefix(keys) == 0

    raw.put_object(Bucket=BUCKET, Key=obj, Body=b"garbage")
    with pytest.raises(CorruptPayload):
        t.load(keys[:1])
    assert t.contains_prefix(keys) == 0 and t.stats().errors == {"corrupt": 1}
    t.close()


def test_s3_creates_a_missing_bucket_before_the_first_write(s3):
    bucket = f"tierserve-new-{uuid.uuid4().hex[:8]}"
    t = s3_tier(s3_config(s3.endpoint_url, s3_bucket=bucket, s3_read_timeout_s=5))
    assert t.contains_prefix(chain(1)) == 0
    assert t.store(chain(1), list(blocks(1))) == 1
    assert t.contains_prefix(chain(1)) == 1


def test_s3_down_at_start_opens_the_breaker_and_lookups_miss_at_once(s3_creds):
    t0 = time.monotonic()
    with TierManager(s3_config(f"http://127.0.0.1:{free_port()}"), FP, SMALL,
                     torch.float32) as mgr:
        assert time.monotonic() - t0 < 2  # building the tier touches no network
        keys = chain(3)
        assert [mgr.lookup(keys).num_blocks for _ in range(2)] == [0, 0]
        s3t = mgr.tiers["s3"]
        assert s3t.breaker_state == "open" and s3t.stats().errors == {"connect": 2}
        t0 = time.monotonic()
        assert mgr.lookup(keys).num_blocks == 0
        assert time.monotonic() - t0 < 0.5
        mgr.store(keys, blocks(3))
        assert mgr.flush(5)
        st = s3t.stats()
        assert st.errors == {"connect": 2, "unavailable": 2} and st.stored_blocks == 0


def test_s3_killed_mid_run_opens_the_breaker_and_a_restart_closes_it(s3):
    keys, x = chain(3), blocks(3)
    with TierManager(s3_config(s3.endpoint_url, s3_read_timeout_s=5), FP, SMALL,
                     torch.float32) as mgr:
        mgr.store(keys, x)
        assert mgr.flush(10) and mgr.lookup(keys).num_blocks == 3
        s3t = mgr.tiers["s3"]

        s3.kill()
        t0 = time.monotonic()
        assert [mgr.lookup(keys).num_blocks for _ in range(3)] == [0, 0, 0]
        assert time.monotonic() - t0 < 3
        assert s3t.breaker_state == "open" and s3t.stats().errors.get("unavailable") == 1

        s3.start()
        time.sleep(0.35)  # the back-off: the next lookup is the half-open probe
        hit = mgr.lookup(keys)
        assert hit.num_blocks == 3 and s3t.breaker_state == "closed"
        got = mgr.start_load(hit).result(timeout=10)
        assert all(same_bits(g, w) for g, w in zip(got, x)) and len(got) == 3


def test_s3_hanging_endpoint_times_out_and_counts_a_failure(s3_creds):
    with hanging_endpoint() as url:
        t = s3_tier(s3_config(url))
        t0 = time.monotonic()
        assert t.contains_prefix(chain(2)) == 0
        assert t.store(chain(1), list(blocks(1))) == 0
        with pytest.raises(TierError):
            t.load(chain(1))
        assert time.monotonic() - t0 < 4
        assert t.stats().errors["timeout"] == 2 and t.breaker_state == "open"
        t.close()


# ---- tier manager --------------------------------------------------------------------------

@pytest.fixture
def mgr(tmp_path):
    cfg = TierConfig(tiers=("cpu", "disk"), disk_dir=str(tmp_path), load_workers=2)
    with TierManager(cfg, FP, SMALL, torch.float32) as m:
        yield m


def test_lookup_continues_the_run_across_tiers_preferring_the_earlier_tier(mgr):
    keys, x = chain(6), blocks(6)
    mgr.tiers["cpu"].store(keys[:3], list(x[:3]))
    mgr.tiers["disk"].store(keys[:5], list(x[:5]))
    hit = mgr.lookup(keys)
    assert hit.sources == ("cpu",) * 3 + ("disk",) * 2 and hit.keys == tuple(keys[:5])
    assert hit.num_tokens == 5 * 4 and hit.blocks_by_tier() == {"cpu": 3, "disk": 2}

    mgr.tiers["cpu"].store(keys[3:4], list(x[3:4]))  # cpu now: 0-3; disk: 0-4
    mgr.tiers["disk"].store(keys[5:], list(x[5:]))
    assert mgr.lookup(keys).sources == ("cpu",) * 4 + ("disk",) * 2
    mgr.tiers["cpu"].remove(keys[1])
    assert mgr.lookup(keys).sources == ("cpu", "disk", "cpu", "cpu", "disk", "disk")


def test_lookup_honours_the_tier_filter_and_the_block_budget(mgr):
    keys, x = chain(5), blocks(5)
    mgr.tiers["cpu"].store(keys[:2], list(x[:2]))
    mgr.tiers["disk"].store(keys, list(x))
    assert mgr.lookup(keys, load_tiers=("disk",)).sources == ("disk",) * 5
    assert mgr.lookup(keys, load_tiers=["cpu"]).num_blocks == 2
    assert mgr.lookup(keys, load_tiers=()).num_blocks == 0
    assert mgr.lookup(keys, max_blocks=3).sources == ("cpu", "cpu", "disk")
    assert mgr.lookup(keys, max_blocks=0).num_blocks == 0
    st = mgr.stats()
    assert (st["cpu"].lookups, st["disk"].lookups) == (2, 2)  # only the tiers asked
    assert (st["cpu"].hit_blocks, st["disk"].hit_blocks) == (4, 6)
    assert st["disk"].hit_tokens == 6 * 4 and st["cpu"].capacity_bytes == TierConfig().cpu_bytes


def test_start_load_reads_in_the_background_and_returns_the_run_in_order(mgr):
    keys, x = chain(4), blocks(4)
    mgr.store(keys[:2], x[:2], store_tiers=("cpu",))
    mgr.store(keys, x, store_tiers=("disk",))
    assert mgr.flush(10)
    mgr.tiers["disk"].delay_s = 0.5
    t0 = time.monotonic()
    handle = mgr.start_load(mgr.lookup(keys))
    assert time.monotonic() - t0 < 0.4 and not handle.done()
    got = handle.result(timeout=10)
    assert handle.done() and len(got) == 4 and all(same_bits(g, w) for g, w in zip(got, x))
    assert handle.seconds >= 0.5 and handle.bytes_loaded == 4 * 512
    st = mgr.stats()
    assert (st["cpu"].loaded_blocks, st["disk"].loaded_blocks) == (2, 2)
    assert st["disk"].load_seconds >= 1.0 and st["disk"].bytes_loaded == 2 * 512


def test_a_cancelled_load_stops_early_and_keeps_only_what_finished(mgr):
    keys, x = chain(6), blocks(6)
    mgr.tiers["disk"].store(keys, list(x))
    mgr.tiers["disk"].delay_s = 0.5
    handle = mgr.start_load(mgr.lookup(keys))  # 2 workers: blocks 0 and 1 start at once
    time.sleep(0.1)
    handle.cancel()
    t0 = time.monotonic()
    got = handle.result(timeout=10)
    assert time.monotonic() - t0 < 0.9 and len(got) == 2  # the rest would take 1 s more
    assert mgr.stats()["disk"].loaded_blocks == 2  # blocks 2-5 were never read


def test_a_load_that_fails_midway_returns_the_leading_run_and_reads_no_further(tmp_path):
    cfg = TierConfig(tiers=("disk",), disk_dir=str(tmp_path), load_workers=1)
    with TierManager(cfg, FP, SMALL, torch.float32) as mgr:
        keys, x = chain(4), blocks(4)
        mgr.tiers["disk"].store(keys, list(x))
        hit = mgr.lookup(keys)
        mgr.tiers["disk"].remove(keys[1])  # gone between lookup and load
        got = mgr.start_load(hit).result(timeout=10)
        assert len(got) == 1 and same_bits(got[0], x[0])
        st = mgr.stats()["disk"]
        assert st.errors == {"miss": 1} and st.loaded_blocks == 1  # blocks 2, 3 not read
        assert mgr.lookup(keys).num_blocks == 1


def test_a_full_store_queue_drops_writes_without_blocking(tmp_path):
    """A slow disk fills its queue and drops writes; the cpu tier beside it takes every one."""
    cfg = TierConfig(tiers=("cpu", "disk"), disk_dir=str(tmp_path), store_queue_depth=2)
    with TierManager(cfg, FP, SMALL, torch.float32) as mgr:
        mgr.tiers["disk"].delay_s = 0.5
        queued = lambda name: mgr.stats()[name].queued_writes  # noqa: E731
        jobs = [(chain(1, seed=i), blocks(1, seed=i)) for i in range(10)]
        mgr.store(*jobs[0])
        wait_until(lambda: queued("disk") == 0)  # the disk writer took job 0, sleeps in it
        accepted, spent = [], 0.0
        for keys, x in jobs[1:]:
            t0 = time.monotonic()
            accepted.append(mgr.store(keys, x))
            spent += time.monotonic() - t0
            wait_until(lambda: queued("cpu") == 0)  # the cpu writer keeps up
        assert spent < 0.4  # a single disk write takes 0.5 s: no call waited for one
        assert accepted == [2, 2] + [1] * 7  # tiers that took each job
        assert mgr.flush(10)
        st = mgr.stats()
        assert st["disk"].dropped_writes == 7 and st["disk"].stored_blocks == 3
        assert st["cpu"].dropped_writes == 0 and st["cpu"].stored_blocks == 10


def test_store_copies_the_callers_blocks_before_returning(mgr):
    keys, x = chain(2), blocks(2)
    src = x.clone()
    mgr.store(keys, src)
    src.zero_()  # the caller reuses its buffer at once
    assert mgr.flush(10)
    for name in ("cpu", "disk"):
        got = mgr.start_load(mgr.lookup(keys, load_tiers=(name,))).result(timeout=10)
        assert len(got) == 2 and all(same_bits(g, w) for g, w in zip(got, x)), name


def test_demote_keeps_device_evictions_in_the_cpu_tier_only(mgr):
    keys = chain(2)
    assert mgr.demote(keys, blocks(2)) == 1
    assert mgr.flush(10)
    assert mgr.tiers["cpu"].keys() == keys[::-1] and mgr.tiers["disk"].keys() == []
    with pytest.raises(ValueError, match="expected"):
        mgr.demote(keys, blocks(2, dtype=torch.float16))
