"""Tensor parallel: one worker process per rank, joined by torch.distributed (gloo on the CPU,
nccl on CUDA), each holding a Megatron-style shard of the model and of the KV cache.

    main process                         rank r of N (a spawned process)
    scheduler, tokenizer, the tiers'     ModelRunner over the shard: its heads' KV cache, its
    scheduler side, server; TPExecutor   own attention route, its tier shards; all-reduce after
    (the runner's face)                  o_proj and down_proj, vocab-parallel embedding (all-
        -- one StepMessage a step -->    reduce) and LM head (all-gather), so every rank has
        <-- rank 0's StepResult          the logits and samples the same tokens

Sharding at load (shard_model): q/k/v by heads (column-parallel; KV heads with the query heads
that read them, replicated when N exceeds the KV heads), o_proj by its input columns (row-
parallel), gate/up by rows, down by columns, embedding and LM head by vocabulary rows (padded to
a multiple of N). The scheduler's block tables and prefix cache are one for all ranks: a block id
means the same positions in every rank's cache.

The step message is compact and typed: per scheduled request its id, start, token count, block
ids, proposals and the output tokens the workers have not seen (a request's prompt and sampling
parameters go once, when it is first scheduled); finished requests are dropped by id. Workers keep
a mirror Request per request id, which is all the runner reads.

The KV tiers: each rank stores and loads its own shard of every block under a key space named by
its rank and the world size; the main process keeps the tiers' scheduler side (tp_tiers.py).

Faults: the executor waits for rank 0's answer while checking every process; a rank that exits
(or reports an error) raises WorkerDied, which stops the engine loop; workers exit when their
pipe closes, so none outlives the main process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Mapping
from multiprocessing.connection import Listener
from dataclasses import dataclass

import numpy as np
import torch

from tierserve.engine.config import EngineConfig, ModelConfig
from tierserve.engine.worker.loaders.lazy import LazyWeights
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""How long the workers may take to load their shards."""


class WorkerDied(RuntimeError):
    """A tensor-parallel rank exited or failed: the engine cannot go on."""


# ---- sharding -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardPlan:
    """Which slice of each dimension rank `rank` of `size` holds."""

    rank: int
    size: int
    cfg: ModelConfig

    def _share(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's `n` consecutive items."""
        return self.rank * n, n

    @property
    def heads(self) -> tuple[int, int]:
        return self._share(self.cfg.num_heads // self.size)

    @property
    def kv_heads(self) -> tuple[int, int]:
        """This rank's KV heads: its share, or (N above the KV heads) the one its queries read."""
        hkv = self.cfg.num_kv_heads
        if self.size <= hkv:
            return self._share(hkv // self.size)
        return self.rank * hkv // self.size, 1

    @property
    def inter(self) -> tuple[int, int]:
        return self._share(self.cfg.intermediate_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        return self._share(-(-self.cfg.vocab_size // self.size))

    def local_config(self) -> ModelConfig:
        return dataclasses.replace(self.cfg, num_heads=self.heads[1],
                                   num_kv_heads=self.kv_heads[1],
                                   intermediate_size=self.inter[1], vocab_size=self.vocab[1])


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """A one-line ValueError when the model's heads or widths do not split over `size` ranks."""
    h, hkv, i = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    why = None
    if h % size:
        why = f"its {h} query heads do not divide by {size}"
    elif size <= hkv and hkv % size:
        why = f"its {hkv} KV heads do not divide by {size}"
    elif size > hkv and size % hkv:
        why = f"{size} ranks cannot share its {hkv} KV heads evenly (replication needs a multiple)"
    elif i % size:
        why = f"its MLP width {i} does not divide by {size}"
    if why:
        raise ValueError(f"tensor_parallel_size {size}: this model cannot be sharded: {why}")


def shard_model(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], rank: int,
                size: int) -> tuple[ModelConfig, LazyWeights]:
    """Rank `rank`'s config and HF-named weights (see the module docstring); each slice is read
    when the model copies it in (a safetensors file's rows through get_slice), not before."""
    plan = ShardPlan(rank, size, cfg)
    d = cfg.head_dim
    (h0, hn), (k0, kn), (i0, i_n), (v0, vn) = plan.heads, plan.kv_heads, plan.inter, plan.vocab
    src = LazyWeights.over(weights)
    whole = slice(None)
    out = {}
    for name in src:
        index: tuple[slice, ...] = ()
        rows = None
        if ".q_proj." in name:
            index = (slice(h0 * d, (h0 + hn) * d),)
        elif ".k_proj." in name or ".v_proj." in name:
            index = (slice(k0 * d, (k0 + kn) * d),)
        elif ".o_proj." in name:
            index = (whole, slice(h0 * d, (h0 + hn) * d))
        elif ".gate_proj." in name or ".up_proj." in name:
            index = (slice(i0, i0 + i_n),)
        elif ".down_proj." in name:
            index = (whole, slice(i0, i0 + i_n))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            index, rows = (slice(v0, v0 + vn),), vn  # the last rank's rows padded with zeros
        out[name] = src.part(name, index, rows)
    return plan.local_config(), LazyWeights(out)


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
"""Bytes of one GGUF block of 32 weights."""


def shard_blocks(blocks: dict, cfg: ModelConfig, rank: int, size: int) -> dict:
    """Rank `rank`'s slices of a GGUF's quantized blocks (--quantization gguf), cut as
    shard_model cuts the weights: rows of a tensor are whole rows of blocks, and a column cut
    falls on block boundaries (widths that do not leave the tensor out: its start then stops
    with gguf's own error). llama.cpp's RoPE row order is permuted within each head, so whole
    heads stay whole."""
    from tierserve.engine.worker.loaders import QuantBlocks

    plan = ShardPlan(rank, size, cfg)
    d = cfg.head_dim
    (h0, hn), (k0, kn), (i0, i_n), (v0, vn) = plan.heads, plan.kv_heads, plan.inter, plan.vocab
    out = {}
    for name, b in blocks.items():
        bpb, (n, k), heads = BLOCK_BYTES[b.kind], b.shape, b.rope_heads
        rows = cols = None
        if ".q_proj." in name:
            rows, heads = (h0 * d, hn * d), (hn if heads else None)
        elif ".k_proj." in name or ".v_proj." in name:
            rows, heads = (k0 * d, kn * d), (kn if heads else None)
        elif ".o_proj." in name:
            cols = (h0 * d, hn * d)
        elif ".gate_proj." in name or ".up_proj." in name:
            rows = (i0, i_n)
        elif ".down_proj." in name:
            cols = (i0, i_n)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = (v0, vn)
        raw = b.raw
        if rows is not None:
            raw = raw[rows[0]:rows[0] + rows[1]]
            if raw.shape[0] < rows[1]:  # the vocabulary's padding: zero blocks decode to 0
                raw = np.concatenate([raw, np.zeros((rows[1] - raw.shape[0], raw.shape[1]),
                                                    raw.dtype)])
            n = rows[1]
        if cols is not None:
            if cols[0] % 32 or cols[1] % 32:
                continue
            raw, k = raw[:, cols[0] // 32 * bpb:(cols[0] + cols[1]) // 32 * bpb], cols[1]
        out[name] = QuantBlocks(np.ascontiguousarray(raw), b.kind, (n, k), heads)
    return out


class Shard:
    """The model's collective calls on one rank (LlamaForCausalLM.tp, Attention/MLP.reduce)."""

    def __init__(self, plan: ShardPlan):
        self.vocab_start, self.vocab_local = plan.vocab
        self.vocab_size = plan.cfg.vocab_size
        self.size = plan.size

    @staticmethod
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x)
        return x

    def embed(self, ids: torch.Tensor, table: torch.nn.Module) -> torch.Tensor:
        """Vocab-parallel lookup in `table` (an embedding, or its quantized form): rows this rank
        holds, zeros elsewhere, summed over ranks."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_local)
        x = table(local.clamp(0, self.vocab_local - 1))
        return self.all_reduce(x * inside[:, None].to(x.dtype))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the logits, in vocabulary order, padding dropped."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        torch.distributed.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


def use_shard(model: torch.nn.Module, shard: Shard) -> None:
    model.tp = shard
    for layer in model.layers:
        layer.self_attn.reduce = shard.all_reduce
        layer.mlp.reduce = shard.all_reduce


# ---- the step message ---------------------------------------------------------------------------

@dataclass(frozen=True)
class NewRequest:
    prompt_token_ids: list[int]
    params: object
    hints: object


@dataclass(frozen=True)
class StepEntry:
    request_id: str
    start: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    samples: bool
    spec_token_ids: tuple[int, ...]
    new_output: tuple[int, ...]
    """Output tokens the workers have not seen yet."""
    new: NewRequest | None = None
    """Sent the first time the request is scheduled."""


@dataclass(frozen=True)
class StepMessage:
    entries: tuple[StepEntry, ...]
    num_batched_tokens: int
    dropped: tuple[str, ...] = ()
    """Requests that finished: the workers forget them."""
    masks: dict = dataclasses.field(default_factory=dict)
    """Structured outputs: the next token's bitmask row (int32 numpy) per constrained request."""
    mask_vocab: int = 0
    """The vocabulary the bitmasks cover (the grammar compiler's)."""


# ---- the worker process -------------------------------------------------------------------------

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
        from tierserve.engine.worker.loaders import load_model_source
        from tierserve.engine.worker.model_runner import ModelRunner

        src = load_model_source(config.model)
        full, blocks = src.config, src.blocks
        cfg, weights = shard_model(full, src.weights, rank, size)
        local = dataclasses.replace(config, device=f"cuda:{rank}" if cuda else config.device,
                                    stack_decode_min_batch=0)
        del src
        runner = ModelRunner(local, cfg, weights, num_blocks, max_model_len,
                             shard_blocks(blocks, full, rank, size))
        del weights, blocks
        use_shard(runner.model, Shard(ShardPlan(rank, size, full)))
        conn.send(("ready", _describe(runner)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    _serve(rank, size, runner, conn)


def main() -> None:
    """`python -m tierserve.engine.worker.tensor_parallel HOST PORT`: a rank, started by the
    main process (a fresh interpreter: multiprocessing's spawn would re-run the caller's
    script). It connects back with the key in TIERSERVE_TP_AUTHKEY and is sent its work."""
    from multiprocessing.connection import Client

    from tierserve.engine.env import set_omp_env

    set_omp_env()
    host, port = sys.argv[1], int(sys.argv[2])
    conn = Client((host, port), authkey=bytes.fromhex(os.environ.pop("TIERSERVE_TP_AUTHKEY")))
    _worker_main(*conn.recv(), conn)


def _describe(runner) -> dict:
    """What the main process reports about the ranks (rank 0's choices; bytes are summed)."""
    return {"backend": runner.backend.name, "sparse": runner.backend.capabilities.sparse,
            "routes": dict(runner.routes),
            "kv_dtype": runner.kv_dtype, "weight_bytes": runner.weight_bytes,
            "kv_bytes": runner.kv_bytes, "block_shape": runner.block_shape,
            "quant_kinds": dict(runner.quant_kinds),
            "graph_reserved_blocks": runner.graph_reserved_blocks}


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
                    from tierserve.engine.worker.device import measure_gpu_kv_bytes

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
    from tierserve.engine.worker.grammar import apply_masks

    return lambda logits, ids: apply_masks(logits, ids, msg.masks, msg.mask_vocab)


def _rank_tiers(runner, config, fingerprint: bytes, rank: int, size: int):
    """This rank's tiers, or the reason they cannot start (the main process raises it)."""
    from tierserve.engine.worker.tp_tiers import RankTiers

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


# ---- the main process's face --------------------------------------------------------------------

class _SparseStats:
    """Rank 0's sparse decode counters (every rank chooses for its own heads), as of the last
    step."""

    def __init__(self):
        from tierserve.engine.worker.sparse import SparseStats

        self.stats = SparseStats()


class _Backend:
    """Rank 0's attention backend, by name (each rank routes its own shapes)."""

    def __init__(self, name: str, sparse: bool):
        self.name = name
        self.capabilities = types.SimpleNamespace(sparse=sparse)


class TPExecutor:
    """What the engine calls in place of a ModelRunner when tensor_parallel_size > 1."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, num_blocks: int,
                 max_model_len: int, size: int, threads: int):
        check_shardable(model_cfg, size)
        self.size = size
        per_rank = max(1, threads // size)
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = dict(os.environ, TIERSERVE_TP_AUTHKEY=key.hex())
        host, lport = listener.address
        self._procs = [subprocess.Popen([sys.executable, "-m", __name__, host, str(lport)],
                                        env=env, start_new_session=False)
                       for _ in range(size)]
        self._conns = []
        self._pending: list[list] = [[] for _ in range(size)]
        """Replies received while waiting for another rank's."""
        self._lock = threading.RLock()
        """One exchange with the ranks at a time: the step loop's, or a reader's poll of the
        tiers' events and counters (tp_tiers.py)."""
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
        first = infos[0]
        self.backend = _Backend(first["backend"], first["sparse"])
        self.routes = first["routes"]
        self.kv_dtype = first["kv_dtype"]
        self.weight_bytes = sum(i["weight_bytes"] for i in infos)
        self.quant_kinds = first["quant_kinds"]
        self.kv_bytes = sum(i["kv_bytes"] for i in infos)
        self.graph_reserved_blocks = first["graph_reserved_blocks"]
        """The decode graphs' scratch block (CUDA graphs on: every rank keeps one)."""
        shape = first["block_shape"]
        self.block_shape = (shape[0], shape[1], shape[2] * size, *shape[3:])
        """One block's KV for every layer and every rank's heads, rank by rank (what the ranks'
        tier shards of a block add up to: the cost model's block bytes)."""
        self.sparse = _SparseStats()
        self._sent: dict[RequestId, tuple[Request, int]] = {}
        log.info("tensor parallel: %d ranks (%s), %d threads each, backend %s", size,
                 "nccl" if config.device.startswith("cuda") else "gloo", per_rank,
                 self.backend.name)

    # ---- the runner's face ---------------------------------------------------------------------

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
            result, self.sparse.stats = self._answer(0)
        return result

    def capture_graphs(self, pool_blocks: int) -> None:
        """Every rank captures its decode graphs (its collectives inside them: NCCL's calls are
        captured like kernels), in lockstep; each replays one whenever the others do, since they
        all decide from the same step message."""
        if self.graph_reserved_blocks:
            self.request_all(("graphs", pool_blocks))

    def gpu_blocks(self, utilization: float) -> int:
        """KV blocks for the GPU cache: each rank profiles a full step on its own GPU and applies
        gpu_memory_utilization (engine/worker/device.py); the tightest rank decides."""
        return min(self.request_all(("gpu_blocks", utilization)))

    def allocate_kv(self, num_blocks: int, max_model_len: int) -> None:
        """Every rank's cache (re)made for num_blocks blocks of its heads."""
        self.kv_bytes = sum(self.request_all(("allocate", (num_blocks, max_model_len))))

    # ---- the KV tiers' channel (tp_tiers.py: each rank moves its own shard) --------------------

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


if __name__ == "__main__":
    main()
