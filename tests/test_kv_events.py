"""KV events for routers: the event log; what real cpu, disk and s3 tiers (SeaweedFS) announce;
what the engine side hands them; GET /v1/kv/events (server-sent events, resumable by seq) on the
real app over a fake engine, and end to end on `tierserve serve`."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import httpx
import torch
import uvicorn

from s3_fixtures import BUCKET
from server_fixtures import MODEL, free_port, run_server
from tierserve.engine.core.kv_connector import KVConnectorScheduler, PolicyCounters
from tierserve.engine.worker.kv_worker import KVConnectorWorker
from tierserve.engine.core.block_hash import extend_hashes, fingerprint
from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.kv_tiers import codec
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.kv_tiers.events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                              EventLog)
from tierserve.engine.kv_tiers.manager import TierManager
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.core.scheduler import FullBlock
from tierserve.server.app import build_app
from tierserve.server.config import ServerConfig
from tierserve.server.routes import kv_events

SMALL = (2, 2, 1, 4, 8)  # [layers, 2, kv_heads, block_size, head_dim]
FP = fingerprint("test-model", "fp32")


def stored(hashes=(b"\x01" * 16,)) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(1, 2),
                       block_size=2, medium="CPU", locality="LOCAL")


def chain(tokens: list[int], block_size: int = 4, extra: bytes = FP) -> list:
    keys: list = []
    extend_hashes(keys, tokens, block_size, extra)
    return keys


def blocks(n: int) -> torch.Tensor:
    return torch.randn((n, *SMALL), generator=torch.Generator().manual_seed(n))


def meta(keys: list, tokens: list[int], bs: int = 4) -> list:
    return [(keys[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs]))
            for i in range(len(keys))]


def manager(tmp_path: Path, **cfg) -> TierManager:
    """Tiers whose events keep token ids (the operator's opt-in), so a test can check them."""
    cfg.setdefault("tiers", ("cpu", "disk"))
    cfg.setdefault("event_token_ids", True)
    return TierManager(TierConfig(disk_dir=str(tmp_path / "kv"), **cfg), FP, SMALL,
                       torch.float32)


def of(log: EventLog, kind: type, medium: str | None = None) -> list:
    return [e.event for e in log.since(0).events
            if isinstance(e.event, kind) and medium in (None, e.event.medium)]


# ---- the log ---------------------------------------------------------------------------------

def test_log_numbers_events_from_one_and_serves_those_past_a_seq():
    log = EventLog(10)
    assert log.last_seq == 0 and log.since(0) == ([], 1)
    assert log.record(stored(), stored()) == 2 and log.record(stored()) == 3
    events, first = log.since(1)
    assert [e.seq for e in events] == [2, 3] and first == 1
    assert log.since(3).events == [] and log.since(1).dropped(1) is None
    j = log.since(2).events[0].to_json()
    assert j["seq"] == 3 and j["type"] == "BlockStored" and abs(j["ts"] - time.time()) < 5
    assert j["block_hashes"] == ["01" * 16] and j["parent_block_hash"] is None
    assert j["token_ids"] == [1, 2] and j["lora_id"] is None and j["medium"] == "CPU"
    assert json.loads(json.dumps(j)) == j


def test_log_ring_overflow_reports_what_a_reader_lost():
    log = EventLog(3)
    log.record(*[stored() for _ in range(5)])  # seqs 1..5; the ring keeps 3..5
    batch = log.since(0)
    assert [e.seq for e in batch.events] == [3, 4, 5] and batch.first_available == 3
    lost = batch.dropped(0)
    assert (lost.first_seq, lost.last_seq) == (1, 2)
    assert lost.to_json() == {"type": "EventsDropped", "first_seq": 1, "last_seq": 2}
    assert [e.seq for e in log.since(3).events] == [4, 5] and log.since(3).dropped(3) is None


def test_log_wait_returns_when_an_event_arrives_or_times_out():
    log = EventLog(4)
    t0 = time.monotonic()
    assert log.wait(0, timeout=0.05) is False and time.monotonic() - t0 >= 0.04
    timer = threading.Timer(0.05, lambda: log.record(stored()))
    timer.start()
    assert log.wait(0, timeout=5) is True and log.last_seq == 1
    assert log.wait(0, timeout=0) is True  # already there: no wait
    timer.join()


# ---- what the tiers announce -----------------------------------------------------------------

def test_store_announces_one_chain_per_tier_with_medium_locality_and_tokens(tmp_path):
    tokens = list(range(100, 112))
    keys = chain(tokens)
    with manager(tmp_path) as mgr:
        assert mgr.store(keys, blocks(3), meta=meta(keys, tokens)) == 2
        assert mgr.flush(10)
        for medium, locality in (("CPU", "LOCAL"), ("STORAGE", "LOCAL")):
            [ev] = of(mgr.events, BlockStored, medium)
            assert ev.block_hashes == tuple(keys) and ev.parent_block_hash is None
            assert ev.token_ids == tuple(tokens) and ev.block_size == 4
            assert ev.locality == locality and ev.lora_id is None
        # present keys are skipped and not announced; the new tail names its parent
        more = tokens + list(range(200, 208))
        keys2 = chain(more)
        mgr.store(keys2, blocks(5), store_tiers=("cpu",), meta=meta(keys2, more))
        assert mgr.flush(10)
        ev = of(mgr.events, BlockStored, "CPU")[-1]
        assert ev.block_hashes == tuple(keys2[3:]) and ev.parent_block_hash == keys2[2]
        assert ev.token_ids == tuple(range(200, 208))
        assert len(of(mgr.events, BlockStored)) == 3


def test_events_carry_no_token_ids_unless_the_operator_opts_in(tmp_path):
    tokens = list(range(100, 112))
    keys = chain(tokens)
    with manager(tmp_path, event_token_ids=False) as mgr:
        mgr.store(keys, blocks(3), meta=meta(keys, tokens))
        assert mgr.flush(10)
        stored = of(mgr.events, BlockStored)  # one per tier
        assert len(stored) == 2 and all(e.token_ids == () for e in stored)
        assert all(e.block_hashes == tuple(keys) for e in stored)  # the hashes still chain
        assert stored[0].parent_block_hash is None
        assert all(e.to_json()["token_ids"] == [] for e in mgr.events.since(0).events
                   if isinstance(e.event, BlockStored))


def test_store_without_meta_and_with_a_gap_splits_into_chains(tmp_path):
    tokens = list(range(16))
    keys = chain(tokens)
    with manager(tmp_path, tiers=("cpu",)) as mgr:
        mgr.store(keys[1:2], blocks(1))  # no meta: parent unknown, no tokens
        assert mgr.flush(10)
        [first] = of(mgr.events, BlockStored)
        assert first.block_hashes == (keys[1],) and first.token_ids == ()
        mgr.store(keys, blocks(4), meta=meta(keys, tokens))  # keys[1] is there: two chains
        assert mgr.flush(10)
        a, b = of(mgr.events, BlockStored)[1:]
        assert (a.block_hashes, a.parent_block_hash, a.token_ids) == \
            ((keys[0],), None, tuple(tokens[:4]))
        assert (b.block_hashes, b.parent_block_hash, b.token_ids) == \
            ((keys[2], keys[3]), keys[1], tuple(tokens[8:]))


def test_eviction_and_removal_announce_block_removed_after_the_store(tmp_path):
    size = len(codec.encode(chain(list(range(4)))[:1], blocks(1)))
    tokens = list(range(20))
    keys = chain(tokens)
    with manager(tmp_path, cpu_bytes=2 * blocks(1).nbytes, disk_bytes=3 * size) as mgr:
        mgr.store(keys[:3], blocks(3), meta=meta(keys, tokens)[:3])
        assert mgr.flush(10)
        # cpu holds 2 of 3: keys[0] is announced stored before its eviction is
        cpu = [e.event for e in mgr.events.since(0).events if e.event.medium == "CPU"]
        assert [type(e) for e in cpu] == [BlockStored, BlockRemoved, BlockStored]
        assert cpu[0].block_hashes == (keys[0], keys[1]) and cpu[1].block_hashes == (keys[0],)
        assert cpu[2].block_hashes == (keys[2],) and cpu[2].parent_block_hash == keys[1]
        assert mgr.tiers["cpu"].keys() == [keys[2], keys[1]]
        mgr.store(keys[3:5], blocks(2), store_tiers=("disk",), meta=meta(keys, tokens)[3:])
        assert mgr.flush(10)
        removed = of(mgr.events, BlockRemoved, "STORAGE")
        assert [k for e in removed for k in e.block_hashes] == [keys[2], keys[1]]  # LRU first
        assert mgr.tiers["disk"].remove(keys[0]) and not mgr.tiers["disk"].remove(keys[0])
        assert of(mgr.events, BlockRemoved, "STORAGE")[-1].block_hashes == (keys[0],)


def test_clear_empties_the_tiers_and_announces_all_blocks_cleared(tmp_path):
    tokens = list(range(12))
    keys = chain(tokens)
    with manager(tmp_path) as mgr:
        mgr.store(keys, blocks(3), meta=meta(keys, tokens))
        assert mgr.flush(10)
        before = mgr.events.last_seq
        assert mgr.clear(("disk",)) == 3
        assert mgr.tiers["disk"].keys() == [] and not list((tmp_path / "kv").rglob("*.safe*"))
        assert len(mgr.tiers["cpu"].keys()) == 3
        assert mgr.clear() == 3 and mgr.tiers["cpu"].keys() == []
        after = [e.event for e in mgr.events.since(before).events]
        assert after == [AllBlocksCleared(medium="STORAGE", locality="LOCAL"),
                         AllBlocksCleared(medium="CPU", locality="LOCAL"),
                         AllBlocksCleared(medium="STORAGE", locality="LOCAL")]
        assert mgr.events.since(before).events[0].to_json()["type"] == "AllBlocksCleared"


def test_demote_announces_the_tokens_without_a_parent(tmp_path):
    tokens = list(range(8))
    keys = chain(tokens)
    with manager(tmp_path) as mgr:
        mgr.demote(keys, blocks(2), meta=[(None, tuple(tokens[:4])), (None, tuple(tokens[4:]))])
        assert mgr.flush(10)
        evs = of(mgr.events, BlockStored)
        assert [(e.medium, e.block_hashes, e.parent_block_hash, e.token_ids) for e in evs] == \
            [("CPU", (keys[0],), None, tuple(tokens[:4])),
             ("CPU", (keys[1],), None, tuple(tokens[4:]))]


def test_s3_clear_deletes_what_this_process_uploaded_and_announces_it(weed, s3_creds, tmp_path):
    if weed.proc is None or weed.proc.poll() is not None:
        weed.start()  # an earlier test left it stopped
    cfg = dict(tiers=("s3",), s3_bucket=BUCKET, s3_prefix=f"ev-{uuid.uuid4().hex[:8]}",
               s3_endpoint_url=weed.endpoint_url, s3_region="us-east-1")
    tokens = list(range(12))
    keys = chain(tokens)
    with manager(tmp_path, **cfg) as ours, manager(tmp_path, **cfg) as other:
        other.store(keys[2:], blocks(1))  # another process's block under the same prefix
        assert other.flush(20)
        ours.store(keys, blocks(3), meta=meta(keys, tokens))
        assert ours.flush(20)
        [ev] = of(ours.events, BlockStored)
        assert ev.block_hashes == tuple(keys[:2]) and (ev.medium, ev.locality) == \
            ("STORAGE", "REMOTE")
        assert ours.clear() == 2
        assert ours.tiers["s3"].keys() == [keys[2]]  # the other's block stays
        assert of(ours.events, AllBlocksCleared) == [
            AllBlocksCleared(medium="STORAGE", locality="REMOTE")]


class FakeRunner:
    """The model runner's one method the worker side's copies use: the KV of device blocks."""

    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return blocks(len(block_ids))


def test_engine_side_stores_full_blocks_as_a_chain_and_demotions_with_their_tokens(tmp_path):
    """The connector hands the tiers the scheduler's full blocks (parent and tokens known) and
    the blocks the device pool takes back (tokens kept by the pool, no parent: one event each)."""
    tokens = list(range(50, 62))
    keys = chain(tokens)
    pool = BlockPool(3, 4, keep_evicted=True)
    mgr = manager(tmp_path, tiers=("cpu",))
    kv = KVConnectorScheduler(mgr.descriptors(), 4, mgr.layout.block_bytes, pool)
    worker = KVConnectorWorker(mgr, FakeRunner())
    worker.attach(kv.cost)
    try:
        ids = pool.allocate(3)
        for i, bid in enumerate(ids):
            pool.publish(bid, keys[i], tokens[4 * i:4 * (i + 1)])
        req = Request(RequestId("r"), tokens, SamplingParams(max_tokens=1), 1)
        full = [FullBlock(keys[i], bid, keys[i - 1] if i else None,
                          tuple(tokens[4 * i:4 * (i + 1)]), req) for i, bid in enumerate(ids)]
        worker.copy_out(kv.stores(full))
        assert mgr.flush(10)
        mgr.clear()  # so the demotion below has something to add
        pool.free(ids)  # last-to-first: allocation takes the tail's blocks first
        pool.allocate(2)
        worker.copy_out(kv.demotions(pool.take_evicted()))
        assert mgr.flush(10)
        assert pool.take_evicted() == []  # taken once
        events = of(mgr.events, BlockStored)
    finally:
        worker.close()
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events] == [
        (tuple(keys), None, tuple(tokens)),
        ((keys[2],), None, tuple(tokens[8:])), ((keys[1],), None, tuple(tokens[4:8]))]


# ---- GET /v1/kv/events -----------------------------------------------------------------------

def read_events(url: str, want, timeout: float = 20.0, headers=None) -> list[tuple[int, dict]]:
    """(id, data) of the stream's events until want(events) holds."""
    events: list[tuple[int, dict]] = []
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", url, timeout=timeout, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        seq = None
        for line in r.iter_lines():
            if line.startswith("id: "):
                seq = int(line[4:])
            elif line.startswith("data: "):
                events.append((seq, json.loads(line[6:])))
                if want(events):
                    return events
            assert time.monotonic() < deadline, f"stream timed out with {events}"
    raise AssertionError(f"stream ended early with {events}")


def hashes_by_medium(events) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for _, e in events:
        if e["type"] == "BlockStored":
            out.setdefault(e["medium"], []).extend(e["block_hashes"])
    return out


def covers(n: int, removed: int = 0):
    return lambda evs: all(len(v) >= n for v in hashes_by_medium(evs).values()) and \
        len(hashes_by_medium(evs)) == 2 and \
        sum(len(e["block_hashes"]) for _, e in evs if e["type"] == "BlockRemoved") >= removed


def complete(server, prompt: list[int]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_server_streams_block_stored_for_both_tiers_and_resumes_by_seq(tmp_path):
    first, second = list(range(1000, 1100)), list(range(2000, 2070))
    # a cpu tier of 8 blocks: the second request's 4 blocks evict 2 of the first's 6; token ids
    # in the events by the operator's opt-in
    with run_server(tmp_path, "--kv-tiers", "cpu,disk", "--disk-tier-dir",
                    str(tmp_path / "kv"), "--cpu-tier-bytes", str(8 * 737_280),
                    "--kv-events-token-ids") as server:
        url = server.v1 + "/kv/events"
        complete(server, first)
        events = read_events(url + "?since=0", covers(6))  # 100 tokens: 6 full blocks
        fp = bytes.fromhex(next((tmp_path / "kv").iterdir()).name)  # the disk tier's folder
        want = [k.hex() for k in chain(first, 16, fp)]
        assert hashes_by_medium(events) == {"CPU": want, "STORAGE": want}
        assert [s for s, _ in events] == [e["seq"] for _, e in events] == \
            list(range(1, len(events) + 1))
        head = next(e for _, e in events if e["medium"] == "CPU")
        assert head["parent_block_hash"] is None and head["token_ids"][:16] == first[:16]
        assert {e["locality"] for _, e in events} == {"LOCAL"}

        last = events[-1][0]
        complete(server, second)  # 70 tokens: 4 more blocks
        more = read_events(f"{url}?since={last}", covers(4, removed=2))
        assert [s for s, _ in more] == list(range(last + 1, last + 1 + len(more)))
        want2 = [k.hex() for k in chain(second, 16, fp)]
        assert hashes_by_medium(more) == {"CPU": want2, "STORAGE": want2}
        removed = [h for _, e in more if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert len(removed) == 2 and set(removed) <= set(want)
        assert {e["medium"] for _, e in more if e["type"] == "BlockRemoved"} == {"CPU"}
        # an EventSource's reconnect header wins over the query
        again = read_events(url + "?since=0", lambda evs: True,
                            headers={"Last-Event-ID": str(last)})
        assert again[0][0] == last + 1
        bad = httpx.get(url, headers={"Last-Event-ID": "x"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


class FakeEngine:
    """The parts of AsyncEngine the app and the events route touch (its published info, the
    drain flag); no model is loaded."""

    def __init__(self, manager: TierManager | None):
        self.info = SimpleNamespace(
            tiers=manager.descriptors() if manager is not None else (),
            events=manager.events if manager is not None else None,
            tier_stats=manager.stats if manager is not None else None,
            policy_counters=PolicyCounters())
        self.draining = False
        self.snapshot = None

    def stop(self) -> None:
        pass


@contextlib.contextmanager
def app_server(manager: TierManager | None) -> Iterator[tuple[str, FakeEngine]]:
    """The real app under uvicorn on a thread, over a fake engine with real tiers."""
    engine, config = FakeEngine(manager), ServerConfig(port=free_port())
    server = uvicorn.Server(uvicorn.Config(build_app(config, engine), host="127.0.0.1",
                                           port=config.port, log_config=None,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}/v1/kv/events", engine
    finally:
        engine.draining = True  # ends open streams, so uvicorn need not wait for them
        server.should_exit = True
        thread.join(10)


def test_events_route_without_tiers_is_a_404_in_openai_shape():
    with app_server(None) as (url, _):
        r = httpx.get(url, timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["message"].startswith("no KV tiers configured") and err["type"] and \
        "code" in err and "param" in err


def test_stream_reports_dropped_events_keeps_alive_and_ends_on_drain(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_events, "KEEPALIVE_S", 0.2)
    with manager(tmp_path, tiers=("cpu",), event_log_size=3) as mgr, \
            app_server(mgr) as (url, engine):
        mgr.clear()  # seq 1: dropped from the ring of 3
        mgr.store(chain(list(range(16))), blocks(4))  # seq 2
        assert mgr.flush(10)
        mgr.clear()  # seq 3
        mgr.clear()  # seq 4
        lines: list[str] = []
        fired = False
        with httpx.stream("GET", url + "?since=0", timeout=10) as r:
            for line in r.iter_lines():
                lines.append(line)
                if line == ": keep-alive" and not fired:
                    fired = True
                    mgr.clear()  # seq 5 arrives on the open stream
                elif line == "id: 5":
                    engine.draining = True  # the stream ends within a poll
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
        ids = [int(x[4:]) for x in lines if x.startswith("id: ")]
        assert events[0] == {"type": "EventsDropped", "first_seq": 1, "last_seq": 1}
        assert ids == [1, 2, 3, 4, 5] and [e.get("seq") for e in events[1:]] == [2, 3, 4, 5]
        assert [e["type"] for e in events[1:]] == ["BlockStored"] + ["AllBlocksCleared"] * 3
        assert ": keep-alive" in lines


def test_stream_ends_when_the_client_goes_away(tmp_path, monkeypatch):
    ended = threading.Event()
    real = kv_events._stream

    async def tracked(*args):
        try:
            async for chunk in real(*args):
                yield chunk
        finally:
            ended.set()

    monkeypatch.setattr(kv_events, "_stream", tracked)
    with manager(tmp_path, tiers=("cpu",)) as mgr, app_server(mgr) as (url, _):
        mgr.clear()
        with httpx.stream("GET", url, timeout=10) as r:
            assert next(r.iter_lines()) == "id: 1"
        assert ended.wait(5)  # not held open by the server after the client closed
