"""A tensor-parallel rank's process: `python -m tierserve.engine.worker.tp.rank HOST PORT`. It
joins the process group, loads its shard into a ModelRunner (which builds the model with this
rank's collectives), then runs what the main process sends: steps, and its own shard of the KV
tiers (RankTiers), until the pipe closes."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
import traceback

import torch

from tierserve.engine.config import EngineConfig
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.kv_tiers.manager import TierManager
from tierserve.engine.worker.device import measure_gpu_kv_bytes
from tierserve.engine.worker.executor import runner_facts
from tierserve.engine.worker.kv_worker import KVConnectorWorker
from tierserve.engine.worker.loaders import load_model_source
from tierserve.engine.worker.model_runner import ModelRunner
from tierserve.engine.worker.tp.protocol import StepMessage, rank_fingerprint, rank_tier_config
from tierserve.engine.worker.tp.shard import Shard, ShardPlan, shard_blocks, shard_model


def _worker_main(rank: int, size: int, port: int, config: EngineConfig, num_blocks: int,
                 max_model_len: int, threads: int, conn) -> None:
    """One rank: join the group, load the shard, then run what the main process sends."""
    try:
        torch.set_num_threads(threads)
        cuda = config.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl" if cuda else "gloo",
                                             init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=size)
        src = load_model_source(config.model)
        full, blocks = src.config, src.blocks
        cfg, weights = shard_model(full, src.weights, rank, size)
        local = dataclasses.replace(config, device=f"cuda:{rank}" if cuda else config.device,
                                    stack_decode_min_batch=0)
        del src
        runner = ModelRunner(local, cfg, weights, num_blocks, max_model_len,
                             shard_blocks(blocks, full, rank, size),
                             tp=Shard(ShardPlan(rank, size, full)))
        del weights, blocks
        conn.send(("ready", runner_facts(runner)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    _serve(rank, size, runner, conn)


def main() -> None:
    """`python -m tierserve.engine.worker.tp.rank HOST PORT`: a rank, started by the
    main process (a fresh interpreter: multiprocessing's spawn would re-run the caller's
    script). It connects back with the key in TIERSERVE_TP_AUTHKEY and is sent its work."""
    from multiprocessing.connection import Client

    from tierserve.engine.env import set_omp_env

    set_omp_env()
    host, port = sys.argv[1], int(sys.argv[2])
    conn = Client((host, port), authkey=bytes.fromhex(os.environ.pop("TIERSERVE_TP_AUTHKEY")))
    _worker_main(*conn.recv(), conn)


def _serve(rank: int, size: int, runner, conn) -> None:
    mirrors: dict[str, Request] = {}
    tiers = None
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # the main process is gone
                return
            try:
                if kind == "stop":
                    return
                if kind == "step":
                    result = runner.execute(_scheduler_output(payload, mirrors),
                                            _constrain(payload))
                    if rank == 0:
                        conn.send(("ok", (result, runner.sparse.stats)))
                elif kind == "gpu_blocks":
                    block = math.prod(runner.block_shape) * runner.kv_dtype.itemsize
                    conn.send(("ok", measure_gpu_kv_bytes(runner, payload) // block))
                elif kind == "graphs":
                    torch.distributed.all_reduce(torch.zeros(1, device=runner.device))
                    torch.cuda.synchronize(runner.device)  # NCCL's communicator made, not captured
                    runner.capture_graphs(payload)
                    conn.send(("ok", None))
                elif kind == "allocate":
                    runner.allocate_kv(*payload)
                    conn.send(("ok", runner.kv_bytes))
                elif kind == "kv_tiers":
                    tiers, answer = _rank_tiers(runner, *payload, rank, size)
                    conn.send(("ok", answer))
                elif kind.startswith("kv_"):
                    answer = tiers.handle(kind, payload)
                    if answer is not None:
                        conn.send(("ok", answer))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
                return
    finally:
        if tiers is not None:
            tiers.close()


def _constrain(msg: StepMessage):
    """The step's grammar masks as the runner's `constrain` (None when no row has one)."""
    if not msg.masks:
        return None
    from tierserve.engine.worker.grammar import apply_masks  # xgrammar: only when a grammar runs

    return lambda logits, ids: apply_masks(logits, ids, msg.masks, msg.mask_vocab)


def _rank_tiers(runner, config, fingerprint: bytes, rank: int, size: int):
    """This rank's tiers, or the reason they cannot start (the main process raises it)."""
    try:
        tiers = RankTiers(runner, config, fingerprint, rank, size)
    except (ValueError, OSError) as e:
        return None, {"error": f"tensor-parallel rank {rank}: KV tiers: {e}"}
    return tiers, tiers.describe()


def _scheduler_output(msg: StepMessage, mirrors: dict[str, Request]) -> SchedulerOutput:
    for rid in msg.dropped:
        mirrors.pop(rid, None)
    scheduled = []
    for e in msg.entries:
        if e.new is not None:
            mirrors[e.request_id] = Request(RequestId(e.request_id), e.new.prompt_token_ids,
                                            e.new.params, 0, hints=e.new.hints)
        req = mirrors[e.request_id]
        req.output_token_ids.extend(e.new_output)
        scheduled.append(ScheduledRequest(req, e.start, e.num_new_tokens, e.block_ids, e.samples,
                                          e.spec_token_ids))
    return SchedulerOutput(tuple(scheduled), msg.num_batched_tokens)


class Measurements:
    """The cost model's observations on this rank, kept for the main process (the CostModel is
    there): the KVConnectorWorker's cost sink, drained by every report."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self._lock = threading.Lock()

    def observe_lookup(self, tier: str, seconds: float) -> None:
        self._record("observe_lookup", (tier, seconds))

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        self._record("observe_load", (tier, nbytes, seconds))

    def observe_copy_in(self, blocks: int, seconds: float) -> None:
        self._record("observe_copy_in", (blocks, seconds))

    def take(self) -> list[tuple[str, tuple]]:
        with self._lock:
            out, self.calls = self.calls, []
        return out

    def _record(self, name: str, args: tuple) -> None:
        with self._lock:
            self.calls.append((name, args))


class RankTiers:
    """A rank's tiers: its TierManager and KVConnectorWorker over its own shard of the cache."""

    def __init__(self, runner, config: TierConfig, fingerprint: bytes, rank: int, size: int):
        self.rank = rank
        self.manager = TierManager(rank_tier_config(config, size),
                                   rank_fingerprint(fingerprint, rank, size), runner.block_shape,
                                   runner.kv_dtype)
        self.measured = Measurements()
        self.worker = KVConnectorWorker(self.manager, runner, config.load_timeout_s)
        self.worker.attach(self.measured)
        self._seq = 0
        """The last of this rank's events relayed."""

    def describe(self) -> dict:
        return {"descriptors": self.manager.descriptors()}

    def handle(self, kind: str, payload):
        """One kv_* message; the answer for kv_poll and kv_flush (None for the others)."""
        w = self.worker
        if kind == "kv_plan":
            w.apply(payload)
        elif kind == "kv_cancel":
            w.cancel(payload)
        elif kind == "kv_copy":
            w.copy_out(payload)
        elif kind == "kv_poll":
            done = [(r.request_id, r.sources, r.abandoned) for r in w.finished()]
            return done, *self._report()
        elif kind == "kv_flush":
            return self.manager.flush(payload), *self._report()
        return None

    def _report(self):
        """Measurements, events (rank 0 only) and counters since the last report."""
        events: list = []
        if self.rank == 0:
            got = self.manager.events.since(self._seq)
            events = [e.event for e in got.events]
            if got.events:
                self._seq = got.events[-1].seq
        return self.measured.take(), events, self.manager.stats()

    def close(self) -> None:
        self.worker.close()


if __name__ == "__main__":
    main()
