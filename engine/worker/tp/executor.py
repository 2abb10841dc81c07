"""The main process's side of tensor parallel: TPExecutor starts a process per rank (a fresh
interpreter running tp/rank.py), sends each step's message to all of them, and takes rank 0's
result, watching every rank meanwhile (a lost one raises WorkerDied)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener

from tierserve.engine.config import EngineConfig, ModelConfig
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.core.scheduler import SchedulerOutput
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.worker.executor import ExecutorFacts
from tierserve.engine.worker.sparse import SparseStats
from tierserve.engine.worker.tp.protocol import NewRequest, StepEntry, StepMessage, WorkerDied
from tierserve.engine.worker.tp.shard import check_shardable
from tierserve.engine.worker.tp.tiers import TPTierWorker

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""How long the workers may take to load their shards."""
RANK_MODULE = "tierserve.engine.worker.tp.rank"
"""What each rank's interpreter runs (`python -m`)."""


class TPExecutor:
    """The engine's executor when tensor_parallel_size > 1: the ranks' processes, one message
    to each a step (engine/worker/executor.py's Executor)."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, num_blocks: int,
                 max_model_len: int, size: int, threads: int):
        check_shardable(model_cfg, size)
        self.size = size
        per_rank = max(1, threads // size)
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = dict(os.environ, TIERSERVE_TP_AUTHKEY=key.hex())
        host, lport = listener.address
        self._procs = [subprocess.Popen([sys.executable, "-m", RANK_MODULE, host, str(lport)],
                                        env=env, start_new_session=False)
                       for _ in range(size)]
        self._conns = []
        self._pending: list[list] = [[] for _ in range(size)]
        """Replies received while waiting for another rank's."""
        self._lock = threading.RLock()
        """One exchange with the ranks at a time: the step loop's, or a reader's poll of the
        tiers' events and counters (tiers.py)."""
        port = _free_port()
        try:
            for rank in range(size):
                conn = _accept(listener, self._procs, START_TIMEOUT_S)
                conn.send((rank, size, port, config, num_blocks, max_model_len, per_rank))
                self._conns.append(conn)
            infos = [self._answer(rank, START_TIMEOUT_S) for rank in range(size)]
        except BaseException:  # a rank that cannot start: none is left behind
            self._kill()
            raise
        finally:
            listener.close()
        first: ExecutorFacts = infos[0]
        shape = first.block_shape
        # a block across every rank's heads, rank by rank (what the ranks' tier shards of a block
        # add up to: the cost model's block bytes); the bytes of every rank summed; the decode
        # graphs' scratch block is every rank's
        self._facts = dataclasses.replace(
            first, weight_bytes=sum(i.weight_bytes for i in infos),
            kv_bytes=sum(i.kv_bytes for i in infos),
            block_shape=(shape[0], shape[1], shape[2] * size, *shape[3:]))
        self._sparse_stats = SparseStats()
        """Rank 0's sparse decode counters (each rank chooses for its own heads), as of the last
        step."""
        self._sent: dict[RequestId, tuple[Request, int]] = {}
        log.info("tensor parallel: %d ranks (%s), %d threads each, backend %s", size,
                 "nccl" if config.device.startswith("cuda") else "gloo", per_rank, first.backend)

    # ---- the Executor ----------------------------------------------------------------------------

    def facts(self) -> ExecutorFacts:
        return self._facts

    def sparse_stats(self) -> SparseStats:
        return self._sparse_stats

    def tier_worker(self, tiers: TierConfig, fingerprint: bytes) -> TPTierWorker:
        """Each rank moves its own shard of every block (tiers.py)."""
        return TPTierWorker(self, tiers, fingerprint)

    def execute(self, out: SchedulerOutput, constrain=None):
        """The step on every rank; rank 0's StepResult. Structured outputs: `constrain` (the
        engine's GrammarBook) fills the constrained rows' bitmasks here, from the matchers this
        process keeps, and they travel in the message (every rank masks its whole logits)."""
        masks = {}
        if constrain is not None:
            masks = constrain.fill([s.request.request_id for s in out.scheduled if s.samples])
        msg = self._message(out)
        if masks:
            msg = dataclasses.replace(msg, masks=masks, mask_vocab=constrain.vocab_size)
        with self._lock:
            self._send_all(("step", msg))
            result, self._sparse_stats = self._answer(0)
        return result

    def capture_graphs(self, pool_blocks: int) -> None:
        """Every rank captures its decode graphs (its collectives inside them: NCCL's calls are
        captured like kernels), in lockstep; each replays one whenever the others do, since they
        all decide from the same step message."""
        if self._facts.graph_reserved_blocks:
            self.request_all(("graphs", pool_blocks))

    def gpu_blocks(self, utilization: float, block_bytes: int) -> int:
        """KV blocks for the GPU cache: each rank profiles a full step on its own GPU and applies
        gpu_memory_utilization (engine/worker/device.py) to its own shard of a block; the
        tightest rank decides."""
        return min(self.request_all(("gpu_blocks", utilization)))

    def allocate_kv(self, num_blocks: int, max_model_len: int) -> None:
        """Every rank's cache (re)made for num_blocks blocks of its heads."""
        kv_bytes = sum(self.request_all(("allocate", (num_blocks, max_model_len))))
        self._facts = dataclasses.replace(self._facts, kv_bytes=kv_bytes)

    # ---- the KV tiers' channel (tiers.py: each rank moves its own shard) -----------------------

    def send_all(self, msg) -> None:
        """A message every rank acts on without answering (in order with the steps)."""
        with self._lock:
            self._send_all(msg)

    def request_all(self, msg) -> list:
        """Every rank's answer to `msg`."""
        with self._lock:
            self._send_all(msg)
            answers = [self._answer(r, START_TIMEOUT_S) for r in range(self.size)]
        failed = next((a["error"] for a in answers if isinstance(a, dict) and "error" in a), None)
        if failed:
            raise ValueError(failed)
        return answers

    @contextlib.contextmanager
    def exchange(self, block: bool = True):
        """Hold the channel (yields False when block is False and someone else holds it)."""
        held = self._lock.acquire(blocking=block)
        try:
            yield held
        finally:
            if held:
                self._lock.release()

    def close(self) -> None:
        with self._lock:
            for rank in range(self.size):
                try:
                    self._send(rank, ("stop", None))
                except WorkerDied:
                    pass
            self._kill(grace=5.0)

    def _kill(self, grace: float = 0.0) -> None:
        for proc in self._procs:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    @property
    def alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)

    # ---- plumbing ------------------------------------------------------------------------------

    def _message(self, out: SchedulerOutput) -> StepMessage:
        dropped = tuple(rid for rid, (req, _) in self._sent.items() if req.status.finished)
        for rid in dropped:
            del self._sent[rid]
        entries = []
        for s in out.scheduled:
            req = s.request
            seen = self._sent.get(req.request_id)
            new = (NewRequest(req.prompt_token_ids, req.params, req.hints) if seen is None
                   else None)
            n = 0 if seen is None else seen[1]
            entries.append(StepEntry(req.request_id, s.start, s.num_new_tokens, s.block_ids,
                                     s.samples, s.spec_token_ids,
                                     tuple(req.output_token_ids[n:]), new))
            self._sent[req.request_id] = (req, len(req.output_token_ids))
        return StepMessage(tuple(entries), out.num_batched_tokens, dropped)

    def _send(self, rank: int, msg) -> None:
        try:
            self._conns[rank].send(msg)
        except (BrokenPipeError, OSError):
            raise self._fail(self._death(rank)) from None

    def _fail(self, why: str) -> WorkerDied:
        """The other ranks wait in a collective for the lost one: stop them all."""
        log.critical("%s; stopping the other ranks", why)
        self._kill()
        return WorkerDied(why)

    def _send_all(self, msg) -> None:
        for rank in range(self.size):
            self._send(rank, msg)

    def _answer(self, rank: int, timeout: float | None = None):
        """Rank `rank`'s reply, watching every rank meanwhile: one that exits or reports an
        error raises WorkerDied (a collective would otherwise wait for it forever). Replies of
        other ranks that arrive meanwhile are kept for their turn."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending[rank]:
            if self._conns[rank].poll(0.05):
                self._receive(rank)
                continue
            for r in range(self.size):
                if r != rank and self._conns[r].poll():
                    self._receive(r)
                if self._procs[r].poll() is not None:
                    raise self._fail(self._death(r))
            if deadline is not None and time.monotonic() > deadline:
                raise self._fail(f"tensor-parallel rank {rank} did not answer in {timeout:g} s")
        return self._pending[rank].pop(0)

    def _receive(self, rank: int) -> None:
        try:
            kind, payload = self._conns[rank].recv()
        except (EOFError, OSError):
            raise self._fail(self._death(rank)) from None
        if kind == "error":
            raise self._fail(f"tensor-parallel rank {rank} failed:\n{payload}")
        self._pending[rank].append(payload)

    def _death(self, rank: int) -> str:
        p = self._procs[rank]
        try:
            code = p.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"was killed by signal {-code}" if code is not None and code < 0 else
               f"exited with status {code}" if code is not None else "stopped answering")
        return f"tensor-parallel rank {rank} (pid {p.pid}) {how}"


def _accept(listener, procs: list[subprocess.Popen], timeout: float):
    """The next worker's connection; WorkerDied if a worker exits before it connects."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(listener.accept()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        thread.join(0.05)
        dead = next((p for p in procs if p.poll() is not None), None)
        if dead is not None:
            raise WorkerDied(f"a tensor-parallel worker (pid {dead.pid}) exited with status "
                             f"{dead.returncode} before it connected")
        if time.monotonic() > deadline:
            raise WorkerDied(f"tensor-parallel workers did not connect in {timeout:g} s")
    return result[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
