"""The synchronous engine: requests in, one scheduled model step at a time, outputs out.

Not thread-safe: one thread owns it (the offline LLM, or the async engine's loop thread)."""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from tierserve.engine.core.block_hash import fingerprint, scope_key
from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.config import EngineConfig, SparseConfig
from tierserve.engine.worker.device import CPU_KV_CACHE_BYTES, DeviceError, detect
from tierserve.engine.detokenizer import IncrementalDetokenizer
from tierserve.engine.info import EngineInfo, SparseStatus
from tierserve.engine.env import configure_threads, set_omp_env
from tierserve.engine.worker.loaders import load_model_source
from tierserve.engine.core.kv_hints import NO_HINTS, KVHints
from tierserve.engine.kv_tiers.config import TierConfig, describe_tiers
from tierserve.engine.worker.model_runner import ModelRunner
from tierserve.engine.worker.executor import Executor, LocalExecutor
from tierserve.engine.worker.tp.executor import TPExecutor
from tierserve.engine.worker.tp.shard import check_shardable
from tierserve.engine.outputs import CompletionOutput, RequestOutput, TopLogprobs
from tierserve.engine.core.request import Request, RequestId, RequestStatus
from tierserve.engine.sampling_params import ParamError, SamplingParams, StructuredOutput
from tierserve.engine.core.scheduler import Scheduler
from tierserve.engine.core.kv_connector import KVConnectorScheduler, NoKVConnector
from tierserve.engine.worker.kv_worker import NoKVWorker
from tierserve.engine.worker.grammar import GrammarBook, GrammarCompiler, GrammarStats
from tierserve.engine.worker.quant import QuantizationError, check_mode, gguf_covers
from tierserve.kernels.native import cpu_has, fused_ops
from tierserve.engine.spec.config import SpeculativeConfig
from tierserve.engine.spec.draft import DraftModelProposer
from tierserve.engine.spec.speculator import SpecStats, Speculator, make_proposer
from tierserve.engine.tokenizer import TextTokenizer
from tierserve.kernels.kv_dtype import kv_elem_size

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since start-up (exported as metrics)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0
    """Tokens run through the model (prompt tokens served from the prefix cache are not)."""
    steps: int = 0
    finished_requests: int = 0
    iteration_tokens: BucketCounts = field(default_factory=lambda: BucketCounts(ITERATION_BUCKETS))
    """Tokens run per step (vllm:iteration_tokens_total)."""
    table_width: BucketCounts = field(default_factory=lambda: BucketCounts(WIDTH_BUCKETS))
    """Block-table width per step, in blocks (a power of two, engine.batch_buffers)."""
    metadata_bytes: BucketCounts = field(default_factory=lambda: BucketCounts(BYTES_BUCKETS))
    """Bytes of metadata views per step."""
    metadata_seconds: float = 0.0
    """Time spent building step inputs and backend metadata."""


ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
WIDTH_BUCKETS = tuple(1 << i for i in range(3, 15))
BYTES_BUCKETS = tuple(1 << i for i in range(8, 25, 2))


@dataclass
class BucketCounts:
    """A histogram in plain ints, kept by the loop thread and exported at scrape time."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    """counts[i]: observations <= bounds[i] and > bounds[i-1]; the last one is above all bounds."""
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value


@dataclass
class _Tracked:
    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    logprobs: list[TopLogprobs] | None
    prompt_logprobs: list[TopLogprobs | None] | None
    metrics: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        set_omp_env()
        self.num_threads = configure_threads(config.num_threads)
        # Resolve auto before the model loads, so a missing GPU fails fast.
        self.device_choice, self.dtype_choice = detect(config.device, config.dtype)
        config = dataclasses.replace(config, device=self.device_choice.device,
                                     dtype=self.dtype_choice.dtype)
        log.info("device: %s (%s); dtype: %s (%s)", config.device, self.device_choice.reason,
                 config.dtype, self.dtype_choice.reason)
        if config.tensor_parallel_size > 1:
            config = _tensor_parallel_config(config)
        self.config = config
        src = load_model_source(config.model)
        if config.tensor_parallel_size > 1:
            check_shardable(src.config, config.tensor_parallel_size)
        native = (config.quantization == "auto" and self.device_choice.type == "cpu"
                  and fused_ops() is not None)
        config = dataclasses.replace(config, quantization=resolve_quantization(
            config.quantization, self.device_choice.type, config.dtype,
            gguf_covers(src.weights, src.blocks), native, cuda_capability(config.device)))
        if config.prefill_bf16 and not (self.device_choice.type == "cpu" and cpu_has("amx_bf16")):
            raise ValueError("prefill_bf16 needs a CPU with AMX (amx_bf16 in /proc/cpuinfo); this "
                             f"{self.device_choice.type} has none: leave it off")
        self.config = config
        self.model_config = src.config
        self.tokenizer = TextTokenizer(src.tokenizer)
        self.model_path = src.path
        bs = config.cache.block_size
        block_bytes = bs * src.config.kv_bytes_per_token(
            kv_elem_size(config.kv_cache_dtype, config.dtype))
        if config.sparse.enabled:  # each block's key summaries (min, max) in every layer, fp32
            mc = src.config
            block_bytes += mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4
        spec = config.speculative_config
        draft = self._draft_source(spec, src) if spec is not None else None
        if draft is not None:  # the draft's blocks come out of the same budget, one per block
            block_bytes += bs * draft.config.kv_bytes_per_token(
                kv_elem_size(config.kv_cache_dtype, config.dtype))
        model_len = min(config.scheduler.max_model_len, src.config.max_position_embeddings,
                        *((draft.config.max_position_embeddings,) if draft is not None else ()))
        profile_gpu = (config.cache.num_blocks is None and config.cache.kv_cache_memory_bytes is None
                       and self.device_choice.type == "cuda")
        if profile_gpu:  # a cache just big enough for the profiling step; resized below
            num_blocks = -(-config.scheduler.max_num_batched_tokens // bs)
            self.max_model_len = max(model_len, config.scheduler.max_num_batched_tokens)
        else:
            kv_bytes = config.cache.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
            num_blocks = config.cache.num_blocks or max(1, kv_bytes // block_bytes)
            self.max_model_len = min(model_len, num_blocks * bs)
        # Everything that changes a block's KV bytes: the model file, dtypes, the fp8 scale, the
        # block size and the layer count. The tiers share blocks across processes by this key.
        self.fingerprint = fingerprint(src.digest, config.dtype, config.kv_cache_dtype,
                                       config.kv_cache_scale, bs, src.config.num_layers,
                                       *(("quantization", config.quantization)
                                         if config.quantization != "none" else ()),
                                       *(("prefill_bf16",) if config.prefill_bf16 else ()),
                                       *(("tp", config.tensor_parallel_size)
                                         if config.tensor_parallel_size > 1 else ()))
        if config.tensor_parallel_size > 1:  # each rank loads its own shard
            self.executor: Executor = TPExecutor(config, src.config, num_blocks,
                                                 self.max_model_len, config.tensor_parallel_size,
                                                 self.num_threads)
        else:
            self.executor = LocalExecutor(ModelRunner(config, src.config, src.weights, num_blocks,
                                                      self.max_model_len, src.blocks))
        facts = self.executor.facts()
        if facts.quant_kinds:
            log.info("quantization %s: %s; weights %.0f MiB", config.quantization,
                     ", ".join(f"{k}: {v}" for k, v in facts.quant_kinds.items()),
                     facts.weight_bytes / 2**20)
        del src
        if profile_gpu:
            num_blocks = self._size_gpu_cache(block_bytes, model_len)
        tiers = config.kv_tiers
        self.pool = BlockPool(num_blocks - facts.graph_reserved_blocks, bs,
                              config.cache.enable_prefix_caching,
                              keep_evicted=tiers is not None and "cpu" in tiers.tiers)
        # a sequence can hold only the pool's blocks (not the CUDA graphs' scratch block)
        self.max_model_len = min(self.max_model_len, self.pool.num_blocks * bs)
        self.executor.capture_graphs(self.pool.num_blocks)
        self.kv, self.kv_worker = self._connector(tiers)
        self.speculator = self._speculator(spec, draft, num_blocks)
        """Speculative decoding's proposer and bookkeeping (None: off)."""
        """The KV connector's scheduler side (torch-free) and worker side: no-ops without
        tiers."""
        self._grammars: GrammarBook | None = None
        self._grammar_lock = threading.Lock()
        self.scheduler = Scheduler(config.scheduler, self.pool, self._hash_extra,
                                   self.kv.on_admit, self._grammar_ready)
        self.stats = EngineStats()
        self._tracked: dict[RequestId, _Tracked] = {}
        self.info = self._describe()
        """What the server may know of this engine (read-only, published once)."""
        facts = self.executor.facts()
        log.info("engine ready: %s, %d layers, %d KV blocks of %d tokens (%.0f MiB), "
                 "max_model_len %d, backend %s, %d threads", config.model,
                 self.model_config.num_layers, num_blocks, bs, facts.kv_bytes / 2**20,
                 self.max_model_len, facts.backend, self.num_threads)

    def _size_gpu_cache(self, block_bytes: int, model_len: int) -> int:
        """Profile a full step, then give the KV cache what gpu_memory_utilization leaves."""
        num_blocks = self.executor.gpu_blocks(self.config.gpu_memory_utilization, block_bytes)
        kv_bytes = num_blocks * block_bytes
        if num_blocks < 1:
            raise DeviceError(f"the KV cache gpu_memory_utilization leaves holds no block of "
                              f"{block_bytes} bytes; raise --gpu-memory-utilization")
        bs = self.config.cache.block_size
        self.max_model_len = min(model_len, num_blocks * bs)
        self.executor.allocate_kv(num_blocks, self.max_model_len)
        log.info("GPU KV cache: %.0f MiB (gpu_memory_utilization %g): %d blocks, %d tokens",
                 kv_bytes / 2**20, self.config.gpu_memory_utilization, num_blocks,
                 num_blocks * bs)
        return num_blocks

    def _draft_source(self, spec: SpeculativeConfig, target):
        """The draft model's weights (draft_model) after checking it can propose for the target:
        the same vocabulary, token for token. None for the n-gram method."""
        if spec.method != "draft_model":
            return None
        draft = load_model_source(spec.model)
        if draft.config.vocab_size != target.config.vocab_size or \
                draft.tokenizer.tokenizer.get_vocab() != target.tokenizer.tokenizer.get_vocab():
            raise ValueError(f"speculative_config: the draft model {spec.model!r} has another "
                             f"vocabulary ({draft.config.vocab_size} tokens) than the target "
                             f"({target.config.vocab_size}); a draft must share the tokenizer")
        return draft

    def _speculator(self, spec: SpeculativeConfig | None, draft,
                    num_blocks: int) -> Speculator | None:
        if spec is None:
            return None

        def draft_proposer() -> DraftModelProposer:
            mode = self.config.quantization
            mode = "auto" if mode in ("auto", "gguf") else mode
            native = self.device_choice.type == "cpu" and fused_ops() is not None
            cfg = dataclasses.replace(
                self.config, model=spec.model, speculative_config=None, kv_tiers=None,
                sparse=SparseConfig(), cuda_graphs=False,
                quantization=resolve_quantization(mode, self.device_choice.type, self.config.dtype,
                                                  gguf_covers(draft.weights, draft.blocks), native))
            runner = ModelRunner(cfg, draft.config, draft.weights, num_blocks, self.max_model_len,
                                 draft.blocks)
            return DraftModelProposer(runner, self.pool.num_blocks, self.config.cache.block_size,
                                      self.config.scheduler.max_num_batched_tokens)

        sparse = self.config.sparse
        k = spec.num_speculative_tokens

        def may_speculate(req: Request) -> bool:
            """No grammar (its matcher advances one accepted token at a time), and a dense decode
            (a verify row attends densely; a sparse row would change its distribution)."""
            return req.params.structured_outputs is None and not (
                sparse.enabled and req.hints.sparse_attention is not False
                and req.num_tokens + k >= sparse.min_context)

        rows = spec.compute_bound_batch
        if rows is None:  # what the quantized kernels take from registers; a GPU: not measured
            rows = 64 if self.device_choice.type == "cuda" else 8 if cpu_has("avx512f") else 4
        log.info("speculative decoding: %s; proposals fill a step up to %s rows", spec.describe(),
                 rows or "any number of")
        return Speculator(spec, make_proposer(spec, draft_proposer), self.max_model_len, rows,
                          may_speculate)

    def _connector(self, tiers: TierConfig | None):
        if tiers is None:
            return NoKVConnector(), NoKVWorker()
        worker = self.executor.tier_worker(tiers, self.fingerprint)  # under TP: a shard a rank
        kv = KVConnectorScheduler(worker.manager.descriptors(), self.config.cache.block_size,
                                  worker.manager.layout.block_bytes, self.pool)
        worker.attach(kv.cost)
        log.info("KV tiers: %s%s (--kv-tiers none turns them off)", describe_tiers(tiers),
                 ", a shard per tensor-parallel rank" if self.config.tensor_parallel_size > 1
                 else "")
        return kv, worker

    def _describe(self) -> EngineInfo:
        facts, sparse, manager = self.executor.facts(), self.config.sparse, self.kv_worker.manager
        return EngineInfo(
            model=self.config.model, max_model_len=self.max_model_len,
            device=self.device_choice, dtype=self.dtype_choice,
            kv_cache_dtype=str(facts.kv_dtype).removeprefix("torch."),
            backend=facts.backend, routes=dict(facts.routes),
            sparse=SparseStatus(sparse.enabled, facts.sparse,
                                sparse.topk_blocks, sparse.topk_ratio, sparse.min_context,
                                sparse.dense_layers),
            tiers=manager.descriptors() if manager is not None else (),
            events=manager.events if manager is not None else None,
            tier_stats=manager.stats if manager is not None else None,
            policy_counters=self.kv.counters, quantization=self.config.quantization,
            quant_kernels=dict(facts.quant_kinds), weight_bytes=facts.weight_bytes,
            tensor_parallel_size=self.config.tensor_parallel_size,
            speculative=(self.config.speculative_config.describe()
                         if self.config.speculative_config is not None else None))

    def close(self) -> None:
        """Stop the tier threads (queued writes finish first, for a few seconds at most) and
        the tensor-parallel workers."""
        self.kv_worker.close()
        self.executor.close()
        if self._grammars is not None:
            self._grammars.compiler.close()

    @property
    def grammars(self) -> GrammarBook:
        """The structured-output grammars, built on first use (xgrammar imports transformers,
        ~2 s): the server builds it at start-up, off the loop thread (compile_grammar)."""
        with self._grammar_lock:
            if self._grammars is None:
                c = self.config
                compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                           tuple(self.model_config.eos_token_ids),
                                           cache_bytes=c.grammar_cache_bytes,
                                           max_bytes=c.grammar_max_bytes,
                                           per_key=c.grammar_compiles_per_key)
                self._grammars = GrammarBook(compiler)
            return self._grammars

    def compile_grammar(self, spec: StructuredOutput, scope: str | None = None) -> cf.Future:
        """Start (or find, within the caller's cache scope) the compile of `spec`; any thread.
        GrammarError inside the future."""
        return self.grammars.compiler.submit(spec, scope)

    def spec_stats(self) -> SpecStats:
        """A copy of speculative decoding's counters (zeros when it is off)."""
        return self.speculator.stats.copy() if self.speculator is not None else SpecStats()

    def grammar_stats(self) -> GrammarStats:
        return self._grammars.stats() if self._grammars is not None else GrammarStats()

    def _grammar_ready(self, req: Request) -> bool:
        return self._grammars is None or self._grammars.ready(req.request_id)

    def _hash_extra(self, req: Request) -> bytes:
        return self.fingerprint + scope_key(req.cache_scope, req.cache_salt)

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None, kv_hints: KVHints | None = None,
                    cache_scope: str | None = None, tenant: str | None = None) -> None:
        """Admit one request, or raise ParamError and keep nothing of it: every check runs
        before the request is recorded."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids, params, cache_salt)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(RequestId(request_id), ids, params, max_tokens, priority=priority,
                      cache_salt=cache_salt, cache_scope=cache_scope, tenant=tenant,
                      hints=kv_hints or NO_HINTS)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                       params.skip_special_tokens)
        self.scheduler.add_request(req)  # hashes the prompt first: a failure records nothing
        if params.structured_outputs is not None:
            self.grammars.add(req.request_id, params.structured_outputs, cache_scope)
        self._tracked[req.request_id] = _Tracked(
            req, text, detok, [] if params.logprobs is not None else None,
            [None] if params.prompt_logprobs is not None else None,
            {"arrival": req.arrival_time})
        self.stats.prompt_tokens += len(ids)

    @property
    def num_tracked(self) -> int:
        """Requests the engine holds state for (admitted and not finished)."""
        return len(self._tracked)

    def check_prompt(self, ids: list[int], params: SamplingParams,
                     cache_salt: str | None = None) -> None:
        if not ids:
            raise ParamError("prompt", "prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ParamError("prompt", f"prompt has {len(ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens, including at least 1 output token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is out of range [0, {vocab})")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ParamError("max_tokens", f"max_tokens ({params.max_tokens}) plus the prompt "
                             f"({len(ids)} tokens) exceeds the context of {self.max_model_len}")
        if len(ids) + params.min_tokens > self.max_model_len:
            raise ParamError("min_tokens", f"min_tokens ({params.min_tokens}) plus the prompt "
                             f"({len(ids)} tokens) exceeds the context of {self.max_model_len}")
        _check_salt(cache_salt)

    def abort_request(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
            self._tracked.pop(req.request_id, None)
            self._forget_grammar(req.request_id)
            if self.speculator is not None:
                self.speculator.finished(req.request_id)
            self.kv.finished([req.request_id])
            self.kv_worker.cancel(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._bring_in_loads()
        refused = self._refused_grammars()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        self.kv.preempted(out.preempted)
        self.kv_worker.start(self.kv.take_loads())
        self.kv_worker.copy_out(self.kv.demotions(self.pool.take_evicted()))  # before reuse
        if out.empty:  # only loads or compiles are in flight: wait instead of spinning
            if not refused:
                self.kv_worker.wait(0.02)
                if self._grammars is not None:
                    self._grammars.wait(0.02)
            return refused
        started = time.monotonic()
        result = self.executor.execute(out, self._grammars)  # GrammarBook: constrain(logits, ids)
        full = self.scheduler.update(out, result.sampled)
        now = time.monotonic()
        self.kv.observe_step(out.num_batched_tokens, now - started)  # the model's time only
        self.kv_worker.copy_out(self.kv.stores(full))
        self.stats.steps += 1
        self.stats.computed_tokens += out.num_batched_tokens
        self.stats.iteration_tokens.observe(out.num_batched_tokens)
        self.stats.table_width.observe(result.table_width)
        self.stats.metadata_bytes.observe(result.metadata_bytes)
        self.stats.metadata_seconds += result.metadata_seconds
        outputs = refused
        for s in out.scheduled:
            rid = s.request.request_id
            tr = self._tracked.get(rid)
            if tr is None:
                continue
            tr.metrics.setdefault("scheduled", started)
            if tr.prompt_logprobs is not None and rid in result.prompt_logprobs:
                tr.prompt_logprobs.extend(result.prompt_logprobs[rid])
            tokens = result.sampled.get(rid)
            if tokens is None:
                continue
            if s.spec_token_ids:
                self.speculator.observe(rid, len(s.spec_token_ids), len(tokens) - 1)
            tr.metrics.setdefault("first_token", now)
            tr.metrics["last_token"] = now
            self._take_tokens(tr, tokens, result.logprobs.get(rid))
            outputs.append(self._output(tr))
        return outputs

    def _take_tokens(self, tr: _Tracked, tokens: list[int], logprobs: list | None) -> None:
        """The step's kept tokens (the update appended them), checked for a stop one at a time
        as if each came from its own step: a stop at one drops the tokens after it."""
        out = tr.request.output_token_ids
        del out[len(out) - len(tokens):]
        for i, tok in enumerate(tokens):
            out.append(tok)
            if logprobs is not None and tr.logprobs is not None:
                tr.logprobs.append(logprobs[i])
            self.stats.generation_tokens += 1
            self._check_stop(tr)
            if tr.request.status.finished:
                return

    def _refused_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile end here, aborted (the server compiles
        before it queues a request, so only an offline caller that did not can get here)."""
        if self._grammars is None:
            return []
        outputs = []
        for rid, error in self._grammars.failed():
            tr = self._tracked.get(RequestId(rid))
            log.warning("request %s: its structured output does not compile: %s", rid, error)
            self.abort_request(rid)
            if tr is not None:
                outputs.append(self._output(tr))
        return outputs

    def _forget_grammar(self, request_id: str) -> None:
        if self._grammars is not None:
            self._grammars.remove(request_id)

    def _bring_in_loads(self) -> None:
        """Finished tier loads into the device cache: blocks placed (a cached block the
        allocation takes goes to the cpu tier first), KV written, then published."""
        placed = self.kv.place(self.kv_worker.finished())
        self.kv_worker.copy_out(self.kv.demotions(self.pool.take_evicted()))
        self.kv_worker.write(placed)
        for p in placed:
            self.scheduler.complete_load(self.scheduler.requests[p.request_id], list(p.block_ids))

    def _check_stop(self, tr: _Tracked) -> None:
        req, p = tr.request, tr.request.params
        tok = req.output_token_ids[-1]
        n = len(req.output_token_ids)
        status, reason = None, None
        if n >= p.min_tokens and tok in p.stop_token_ids:
            status, reason = RequestStatus.FINISHED_STOPPED, tok
        elif n >= p.min_tokens and not p.ignore_eos and tok in self.model_config.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        hit = tr.detok.add(req.output_token_ids)
        if status is None and hit is not None:
            status, reason = RequestStatus.FINISHED_STOPPED, hit
        if self._grammars is not None and self._grammars.accept(req.request_id, tok) \
                and status is None:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if status is None and (n >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if hit is None:
                tr.detok.flush(req.output_token_ids)
            req.stop_reason = reason
            self.scheduler.finish_requests([req.request_id], status)
            self._forget_grammar(req.request_id)
            if self.speculator is not None:
                self.speculator.finished(req.request_id)
            self.stats.finished_requests += 1

    def _output(self, tr: _Tracked) -> RequestOutput:
        req = tr.request
        done = req.status.finished
        if done:
            self._tracked.pop(req.request_id, None)
        comp = CompletionOutput(0, tr.detok.visible(done), list(req.output_token_ids),
                                list(tr.logprobs) if tr.logprobs is not None else None,
                                req.status.value if done else None, req.stop_reason)
        decision, hits = self.kv.facts(req)
        if done:
            self.kv.finished([req.request_id])
        return RequestOutput(req.request_id, tr.prompt, req.prompt_token_ids, [comp], done,
                             tr.prompt_logprobs, req.num_cached_tokens, dict(tr.metrics),
                             decision, hits)


def _check_salt(salt: str | None) -> None:
    """A salt is a non-empty string of valid Unicode (vLLM refuses an empty one too): "" would
    read as "no salt" in one place and as a salt in another."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ParamError("cache_salt", "cache_salt must be a non-empty string when given")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise ParamError("cache_salt", "cache_salt must be valid Unicode (it holds a lone "
                         "surrogate)") from None


def _tensor_parallel_config(config: EngineConfig) -> EngineConfig:
    """The settings tensor parallel runs with, or a one-line ValueError for what it cannot run
    yet (docs/parallel.md)."""
    size = config.tensor_parallel_size
    if config.device.startswith("cuda") and size > torch_cuda_count():
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; "
                         f"{torch_cuda_count()} visible")
    return config


def cuda_capability(device: str) -> tuple[int, int] | None:
    """The GPU's compute capability, or None off CUDA."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_capability(torch.device(device))


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def resolve_quantization(mode: str, device_type: str, dtype: str, has_q4_blocks: bool,
                         native: bool = True, capability: tuple[int, int] | None = None) -> str:
    """--quantization as it will run: auto keeps a GGUF's blocks on the CPU in float32 where
    every decoder linear has blocks the kernels take (has_q4_blocks: quant.gguf_covers) and the
    native kernels are built (they give the fp32 path's bits from a fifth of the bytes), else
    none. An explicit mode runs on the CPU in float32, or on CUDA in bfloat16 with compute
    capability 8.0 or newer (torch's tinygemm int4 kernel; `capability`: the GPU's)."""
    check_mode(mode)
    here = device_type == "cpu" and dtype == "float32"
    if mode == "auto":
        return "gguf" if here and has_q4_blocks and native else "none"
    if mode == "none" or here:
        return mode
    if device_type != "cuda" or dtype != "bfloat16":
        raise QuantizationError(f"quantization {mode} runs on the CPU with dtype float32 or on "
                                f"CUDA with bfloat16, not {device_type} with {dtype}; use none")
    if capability is not None and capability < (8, 0):
        raise QuantizationError(f"quantization {mode} on CUDA needs compute capability 8.0 or "
                                f"newer (torch's int4 kernel); this GPU has "
                                f"{capability[0]}.{capability[1]}: use none")
    return mode
