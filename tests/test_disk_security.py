"""The disk tier keeps other local users out: modes 0700/0600, and a keyed checksum.

Real files under tmp_path and real processes (a writer killed mid-write, processes racing to make
the secret); the s3 cases use the real S3 server of tests/s3_fixtures.py.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
import torch
from safetensors.torch import load, save

from s3_fixtures import BUCKET
from tierserve.engine.core.block_hash import extend_hashes, fingerprint
from tierserve.engine.kv_tiers import codec, private
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.kv_tiers.errors import CorruptPayload
from tierserve.engine.kv_tiers.layout import BlockLayout
from tierserve.engine.kv_tiers.manager import TierManager
from tierserve.engine.kv_tiers.registry import create_tier

SMALL = (2, 2, 1, 4, 8)  # [layers, 2, kv_heads, block_size, head_dim]
FP = fingerprint("test-model", "fp32")


def chain(n: int, seed: int = 0) -> list:
    keys: list = []
    extend_hashes(keys, [seed * 1000 + t for t in range(4 * n)], 4, FP)
    return keys


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *SMALL), generator=torch.Generator().manual_seed(seed))


def disk(folder: Path, **cfg):
    return create_tier("disk", TierConfig(tiers=("disk",), disk_dir=str(folder), **cfg),
                       BlockLayout(FP, SMALL, torch.float32))


def manager(folder: Path) -> TierManager:
    return TierManager(TierConfig(tiers=("disk",), disk_dir=str(folder), load_workers=1), FP,
                       SMALL, torch.float32)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def meta_of(data: bytes) -> dict:
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8:8 + n])["__metadata__"]


@pytest.fixture(params=[0o022, 0o002, 0o000], ids=["umask022", "umask002", "umask000"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


# ---- modes -----------------------------------------------------------------------------------

def test_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path, umask):
    top = tmp_path / "cache"  # neither it nor the folders under it exist yet
    t = disk(top / "tierserve" / "kv")
    keys = chain(3)
    assert t.store(keys, list(blocks(3))) == 3
    made = [top, *top.rglob("*")]
    folders = [p for p in made if p.is_dir()]
    files = [p for p in made if p.is_file()]
    shards = {k.hex()[:2] for k in keys}
    assert len(folders) == 4 + len(shards)  # cache, tierserve, kv, the model's, its shards
    assert len(files) == 3 + 1  # the blocks and the secret
    assert {str(p): oct(mode(p)) for p in folders} == {str(p): "0o700" for p in folders}
    assert {str(p): oct(mode(p)) for p in files} == {str(p): "0o600" for p in files}
    assert (top / "tierserve" / "kv" / ".secret") in files


def test_a_temp_file_is_0600_from_its_first_byte(tmp_path):
    """A writer killed between writing its temp file and the rename, under umask 022: the temp
    file it leaves was never readable by others."""
    key = chain(1)[0]
    code = ("import os, torch\n"
            "os.umask(0o022)\n"
            "from tierserve.engine.kv_tiers.config import TierConfig\n"
            "from tierserve.engine.kv_tiers.layout import BlockLayout\n"
            "from tierserve.engine.kv_tiers.disk import DiskTier\n"
            f"t = DiskTier(TierConfig(tiers=('disk',), disk_dir={str(tmp_path)!r}),\n"
            f"             BlockLayout({FP!r}, {SMALL!r}, torch.float32))\n"
            "os.replace = lambda *a: os._exit(9)\n"
            f"t.store([bytes.fromhex({key.hex()!r})], [torch.ones({SMALL!r})])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 9, r.stderr
    (tmp,) = tmp_path.rglob("*.tmp")
    assert mode(tmp) == 0o600 and mode(tmp.parent) == 0o700


def test_a_model_folder_an_older_version_left_open_is_closed_at_start(tmp_path):
    root = tmp_path / FP.hex()
    (root / "ab").mkdir(parents=True)
    root.chmod(0o755)
    disk(tmp_path)
    assert mode(root) == 0o700


# ---- the secret ------------------------------------------------------------------------------

def test_the_secret_is_made_once_0600_and_a_restart_reads_the_first_runs_blocks(tmp_path):
    keys, x = chain(3), blocks(3)
    with manager(tmp_path) as first:
        first.store(keys, x)
        assert first.flush(10)
    secret = tmp_path / ".secret"
    text = secret.read_text()
    assert mode(secret) == 0o600 and len(text.strip()) == 64 and int(text, 16) > 0
    with manager(tmp_path) as again:  # a restart: the same secret, the same blocks
        got = again.start_load(again.lookup(keys)).result(timeout=10)
        assert len(got) == 3 and all(same(g, w) for g, w in zip(got, x))
        assert again.stats()["disk"].errors == {}
    assert secret.read_text() == text


def test_processes_starting_together_agree_on_one_secret(tmp_path):
    code = ("import sys\n"
            "from tierserve.engine.kv_tiers import private\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"  # all wait here until every one is ready, then race
            f"print(private.load_or_create_secret({str(tmp_path)!r}).hex())\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    assert [p.stdout.readline() for p in procs] == ["ready\n"] * 6
    for p in procs:
        p.stdin.close()
    keys = {p.stdout.read().strip() for p in procs}
    assert [p.wait(timeout=60) for p in procs] == [0] * 6
    assert len(keys) == 1 and len(keys.pop()) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == [".secret"]  # no temp file left


def test_a_secret_open_to_other_users_is_not_used(tmp_path, caplog):
    keys, x = chain(2), blocks(2)
    disk(tmp_path).store(keys, list(x))
    (tmp_path / ".secret").chmod(0o644)  # anyone may have read it: forged blocks would pass
    t = disk(tmp_path)
    assert "no usable secret" in caplog.text and "0600" in caplog.text
    assert t.contains_prefix(keys) == 2
    with pytest.raises(CorruptPayload):
        t.load(keys[:1])
    assert t.stats().errors == {"corrupt": 1} and t.contains_prefix(keys) == 0


# ---- planted and old files -------------------------------------------------------------------

def plain(keys, x) -> bytes:
    """A payload anyone can make: format /1 with the plain checksum (as older versions wrote)."""
    return codec.encode(keys, x)


def forged(keys, x) -> bytes:
    """Format /2, the checksum recomputed without the key."""
    t = x.contiguous()
    meta = {"format": codec.FORMAT_KEYED, "keys": ",".join(k.hex() for k in keys),
            "dtype": "float32", "block_shape": ",".join(map(str, SMALL)),
            "checksum": codec.checksum(t)}
    return save({"kv": t}, metadata=meta)


def wrong_key(keys, x) -> bytes:
    return codec.encode(keys, x, mac_key=os.urandom(32))


@pytest.mark.parametrize("make", [plain, forged, wrong_key])
def test_a_planted_block_is_a_miss_counted_corrupt_and_deleted(tmp_path, make):
    keys, x = chain(4), blocks(4)
    evil = blocks(1, seed=66)
    with manager(tmp_path) as mgr:
        mgr.store(keys, x)
        assert mgr.flush(10)
        t = mgr.tiers["disk"]
        planted = Path(t.path(keys[2]))
        planted.write_bytes(make(keys[2:3], evil))
        got = mgr.start_load(mgr.lookup(keys)).result(timeout=10)
        assert len(got) == 2 and all(same(g, w) for g, w in zip(got, x))  # the run stops there
        assert not planted.exists() and t.stats().errors == {"corrupt": 1}
        assert mgr.lookup(keys).num_blocks == 2


def test_a_real_block_relabelled_to_another_key_fails_its_check(tmp_path):
    """The keyed checksum covers the header too: a genuine payload whose keys field is edited
    (and the file renamed) to another prefix's key does not pass."""
    a, b = chain(1, seed=1), chain(1, seed=2)
    t = disk(tmp_path)
    t.store(a, list(blocks(1, seed=1)))
    t.store(b, list(blocks(1, seed=2)))
    data = Path(t.path(a[0])).read_bytes()
    meta = {**meta_of(data), "keys": b[0].hex()}
    Path(t.path(b[0])).write_bytes(save(load(data), metadata=meta))
    with pytest.raises(CorruptPayload, match="checksum"):
        t.load(b)
    assert t.stats().errors == {"corrupt": 1}


def test_files_written_before_the_keyed_checksum_are_misses_and_nothing_breaks(tmp_path):
    keys, x = chain(3), blocks(3)
    t = disk(tmp_path)
    for k, b in zip(keys, x):  # as an older version left them: plain checksum, mode 0644
        path = Path(t.path(k))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(plain([k], b.unsqueeze(0)))
        path.chmod(0o644)
    with manager(tmp_path) as mgr:  # the restart indexes them ...
        assert mgr.lookup(keys).num_blocks == 3
        assert mgr.start_load(mgr.lookup(keys)).result(timeout=10) == []  # ... none loads
        for k in keys[1:]:
            with pytest.raises(CorruptPayload, match="format"):
                mgr.tiers["disk"].load([k])
        assert mgr.stats()["disk"].errors == {"corrupt": 3} and mgr.lookup(keys).num_blocks == 0
        mgr.store(keys, x)  # stored again, keyed, 0600
        assert mgr.flush(10)
        got = mgr.start_load(mgr.lookup(keys)).result(timeout=10)
        assert len(got) == 3 and all(same(g, w) for g, w in zip(got, x))
        path = Path(mgr.tiers["disk"].path(keys[0]))
        assert mode(path) == 0o600 and meta_of(path.read_bytes())["format"] == "tierserve-kv/2"


def test_keyed_and_plain_payloads_have_the_same_size():
    keys, x = chain(2), blocks(2)
    keyed = codec.encode(keys, x, mac_key=os.urandom(32))
    assert len(keyed) == len(codec.encode(keys, x))
    with pytest.raises(CorruptPayload, match="format"):
        codec.decode(keyed, keys, torch.float32, SMALL)  # a keyed payload needs its key


# ---- s3 --------------------------------------------------------------------------------------

def test_s3_keeps_the_plain_checksum_so_replicas_share_blocks(weed, s3_creds):
    """Replicas share s3 blocks without sharing a secret: the bucket's credentials keep writers
    out there, and the payloads stay format /1, readable by any replica (and older versions)."""
    if weed.proc is None or weed.proc.poll() is not None:
        weed.start()
    cfg = TierConfig(tiers=("s3",), s3_bucket=BUCKET, s3_prefix=f"t-{uuid.uuid4().hex[:8]}",
                     s3_endpoint_url=weed.endpoint_url, s3_region="us-east-1")
    a, b = (create_tier("s3", cfg, BlockLayout(FP, SMALL, torch.float32)) for _ in range(2))
    keys, x = chain(2), blocks(2)
    assert a.store(keys, list(x)) == 2
    assert all(same(g, w) for g, w in zip(b.load(keys), x))
    client = boto3.client("s3", endpoint_url=weed.endpoint_url, region_name="us-east-1")
    raw = client.get_object(Bucket=BUCKET, Key=a.object_key(keys[0]))["Body"].read()
    assert meta_of(raw)["format"] == codec.FORMAT
    assert same(codec.decode(raw, keys[:1], torch.float32, SMALL)[0], x[0])
    a.close()
    b.close()
