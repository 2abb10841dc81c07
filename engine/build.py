"""Building an engine, apart from running one: the config settled once (device and dtype chosen,
quantization resolved), the model source loaded, the KV cache sized, the executor started (in
this process, or one per tensor-parallel rank), the block pool, the KV connector's two sides and
the speculator. LLMEngine (llm_engine.py) takes the parts and runs the step loop.

    config -> device, dtype -> model source -> quantization -> block bytes, KV blocks
           -> fingerprint -> executor -> (GPU: profile, resize) -> pool -> graphs
           -> KV connector -> speculator
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from tierserve.engine.config import GGUF_MODES, EngineConfig, ModelConfig, SparseConfig
from tierserve.engine.core.block_hash import fingerprint
from tierserve.engine.core.block_pool import BlockPool
from tierserve.engine.core.kv_connector import KVConnectorScheduler, NoKVConnector
from tierserve.engine.core.request import Request
from tierserve.engine.env import configure_threads, set_omp_env
from tierserve.engine.info import EngineInfo, SparseStatus
from tierserve.engine.extensions import KVExtension
from tierserve.engine.kv_tiers.config import TierConfig, describe_tiers
from tierserve.engine.spec.config import SpeculativeConfig
from tierserve.engine.spec.draft import DraftModelProposer
from tierserve.engine.spec.speculator import Speculator, make_proposer
from tierserve.engine.tokenizer import TextTokenizer
from tierserve.engine.worker.device import (CPU_KV_CACHE_BYTES, DeviceChoice, DeviceError,
                                            DtypeChoice, cuda_capability, detect,
                                            torch_cuda_count)
from tierserve.engine.worker.executor import Executor, LocalExecutor
from tierserve.engine.worker.kv_worker import NoKVWorker
from tierserve.engine.worker.loaders import ModelSource, load_model_source
from tierserve.engine.worker.model_runner import ModelRunner
from tierserve.engine.worker.quant import gguf_covers, gguf_uncovered, resolve_quantization
from tierserve.engine.worker.tp.executor import TPExecutor
from tierserve.engine.worker.tp.shard import check_shardable
from tierserve.kernels.kv_dtype import kv_elem_size
from tierserve.kernels.native import cpu_has, fused_ops

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything LLMEngine runs with, built and sized."""

    config: EngineConfig
    """The settings as they run: device, dtype and quantization resolved."""
    device_choice: DeviceChoice
    dtype_choice: DtypeChoice
    num_threads: int
    model_config: ModelConfig
    tokenizer: TextTokenizer
    model_path: str
    executor: Executor
    pool: BlockPool
    num_blocks: int
    """KV blocks in the cache (the pool's, plus the CUDA graphs' scratch when captured)."""
    max_model_len: int
    fingerprint: bytes
    """Everything that changes a block's KV bytes: the tiers share blocks by this key."""
    kv: KVExtension
    speculator: Speculator | None


@dataclass
class _Sizing:
    block_bytes: int
    """One block's bytes across every layer: KV, sparse summaries, the draft's KV."""
    model_len: int
    """The longest context the model (and its draft) take."""
    num_blocks: int
    max_model_len: int
    profile_gpu: bool
    """The GPU cache is sized by profiling once the model is loaded (resized then)."""


def build_engine(config: EngineConfig) -> EngineParts:
    set_omp_env()
    threads = configure_threads(config.num_threads)
    config, device, dtype = _choose_device(config)
    src = load_model_source(config.model)
    check_windowed(config, src.config)
    if config.tensor_parallel_size > 1:
        check_shardable(src.config, config.tensor_parallel_size)
    config = _resolve_quantization(config, src, device)
    spec = config.speculative_config
    draft = _draft_source(spec, src) if spec is not None else None
    size = _size(config, src, draft, device)
    fp = _fingerprint(config, src)
    executor = _executor(config, src, size, threads)
    tokenizer, model_config, path = TextTokenizer(src.tokenizer), src.config, src.path
    del src  # the weights are the executor's now
    if size.profile_gpu:
        _size_gpu_cache(executor, config, size)
    tiers = config.kv_tiers
    pool = BlockPool(size.num_blocks - executor.facts().graph_reserved_blocks,
                     config.cache.block_size, config.cache.enable_prefix_caching,
                     keep_evicted=tiers is not None and "cpu" in tiers.tiers)
    # a sequence can hold only the pool's blocks (not the CUDA graphs' scratch block)
    max_model_len = min(size.max_model_len, pool.num_blocks * config.cache.block_size)
    executor.capture_graphs(pool.num_blocks)
    kv = _connector(config, executor, fp, pool)
    speculator = (_speculator(config, spec, draft, device, pool, size.num_blocks, max_model_len)
                  if spec is not None else None)
    return EngineParts(config, device, dtype, threads, model_config, tokenizer, path, executor,
                       pool, size.num_blocks, max_model_len, fp, kv, speculator)


def engine_info(parts: EngineParts) -> EngineInfo:
    """What the server may know of the engine (read-only, published once)."""
    facts, config = parts.executor.facts(), parts.config
    sparse, manager = config.sparse, parts.kv.worker.manager
    return EngineInfo(
        model=config.model, max_model_len=parts.max_model_len,
        device=parts.device_choice, dtype=parts.dtype_choice,
        kv_cache_dtype=str(facts.kv_dtype).removeprefix("torch."),
        backend=facts.backend, routes=dict(facts.routes),
        sparse=SparseStatus(sparse.enabled, facts.sparse, sparse.topk_blocks, sparse.topk_ratio,
                            sparse.min_context, sparse.dense_layers),
        tiers=manager.descriptors() if manager is not None else (),
        events=manager.events if manager is not None else None,
        tier_stats=manager.stats if manager is not None else None,
        policy_counters=parts.kv.scheduler.counters, quantization=config.quantization,
        quant_kernels=dict(facts.quant_kinds), weight_bytes=facts.weight_bytes,
        tensor_parallel_size=config.tensor_parallel_size,
        speculative=(config.speculative_config.describe()
                     if config.speculative_config is not None else None))


# ---- the settings ------------------------------------------------------------------------------

def _choose_device(config: EngineConfig) -> tuple[EngineConfig, DeviceChoice, DtypeChoice]:
    """auto resolved before the model loads, so a missing GPU fails fast."""
    device, dtype = detect(config.device, config.dtype)
    config = dataclasses.replace(config, device=device.device, dtype=dtype.dtype)
    log.info("device: %s (%s); dtype: %s (%s)", config.device, device.reason, config.dtype,
             dtype.reason)
    size = config.tensor_parallel_size
    if size > 1 and config.device.startswith("cuda") and size > torch_cuda_count():
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; "
                         f"{torch_cuda_count()} visible")
    return config, device, dtype


def check_windowed(config: EngineConfig, mc: ModelConfig) -> None:
    """The options a model with sliding-window layers cannot take yet, refused in one line."""
    if not mc.windowed:
        return
    why = None
    if config.sparse.enabled:
        why = ("sparse top-k decode: its block choice and kernels see the whole context, not a "
               "windowed layer's last positions")
    elif config.speculative_config is not None:
        why = ("speculative decoding: its verify rows and draft runner are not yet checked "
               "against windowed attention")
    if why:
        raise ValueError(f"{mc.architecture} has sliding-window layers (window "
                         f"{mc.sliding_window}); this engine cannot run it with {why}")


def int8_dot_cpu() -> bool:
    """Whether this CPU runs q4i8_linear's vector path (kernels/csrc/q4_int8.cpp)."""
    return all(cpu_has(f) for f in ("avx2", "fma", "f16c"))


def _resolve_quantization(config: EngineConfig, src: ModelSource,
                          device: DeviceChoice) -> EngineConfig:
    auto = config.quantization == "auto"
    native = auto and device.type == "cpu" and fused_ops() is not None
    config = dataclasses.replace(config, quantization=resolve_quantization(
        config.quantization, device.type, config.dtype, gguf_covers(src.weights, src.blocks),
        native, cuda_capability(config.device), int8_dot=int8_dot_cpu()))
    if auto and config.quantization == "gguf":
        log.info("quantization auto: gguf (this CPU has AVX2, FMA and F16C: the Q4 linears take "
                 "int8 activations and integer dot products at every batch size; "
                 "--quantization gguf-exact keeps the fp32 path's bits)")
    elif auto and config.quantization == "gguf-exact":
        log.info("quantization auto: gguf-exact (no AVX2, FMA and F16C on this CPU for the int8 "
                 "dot products: the Q4 blocks are decoded to fp32 as they are used)")
    elif auto and src.blocks and (uncovered := gguf_uncovered(src.weights, src.blocks)):
        log.info("quantization auto: none (no kernel keeps %s: every weight is dequantized to "
                 "%s)", uncovered, config.dtype)
    if config.prefill_bf16 and not (device.type == "cpu" and cpu_has("amx_bf16")):
        raise ValueError("prefill_bf16 needs a CPU with AMX (amx_bf16 in /proc/cpuinfo); this "
                         f"{device.type} has none: leave it off")
    return config


def _fingerprint(config: EngineConfig, src: ModelSource) -> bytes:
    """Everything that changes a block's KV bytes: the model file, dtypes, the fp8 scale, the
    block size and the layer count. The tiers share blocks across processes by this key."""
    return fingerprint(src.digest, config.dtype, config.kv_cache_dtype, config.kv_cache_scale,
                       config.cache.block_size, src.config.num_layers,
                       *(("quantization", config.quantization)
                         if config.quantization != "none" else ()),
                       *(("prefill_bf16",) if config.prefill_bf16 else ()),
                       *(("tp", config.tensor_parallel_size)
                         if config.tensor_parallel_size > 1 else ()))


# ---- memory ------------------------------------------------------------------------------------

def _size(config: EngineConfig, src: ModelSource, draft: ModelSource | None,
          device: DeviceChoice) -> _Sizing:
    bs = config.cache.block_size
    block_bytes = bs * src.config.kv_bytes_per_token(
        kv_elem_size(config.kv_cache_dtype, config.dtype))
    if config.sparse.enabled:  # each block's key summaries (min, max) in every layer, fp32
        mc = src.config
        block_bytes += mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4
    if draft is not None:  # the draft's blocks come out of the same budget, one per block
        block_bytes += bs * draft.config.kv_bytes_per_token(
            kv_elem_size(config.kv_cache_dtype, config.dtype))
    model_len = min(config.scheduler.max_model_len, src.config.max_position_embeddings,
                    *((draft.config.max_position_embeddings,) if draft is not None else ()))
    profile_gpu = (config.cache.num_blocks is None and config.cache.kv_cache_memory_bytes is None
                   and device.type == "cuda")
    if profile_gpu:  # a cache just big enough for the profiling step; resized later
        num_blocks = -(-config.scheduler.max_num_batched_tokens // bs)
        max_model_len = max(model_len, config.scheduler.max_num_batched_tokens)
    else:
        kv_bytes = config.cache.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
        num_blocks = config.cache.num_blocks or max(1, kv_bytes // block_bytes)
        max_model_len = min(model_len, num_blocks * bs)
    return _Sizing(block_bytes, model_len, num_blocks, max_model_len, profile_gpu)


def _executor(config: EngineConfig, src: ModelSource, size: _Sizing, threads: int) -> Executor:
    if config.tensor_parallel_size > 1:  # each rank loads its own shard
        executor: Executor = TPExecutor(config, src.config, size.num_blocks, size.max_model_len,
                                        config.tensor_parallel_size, threads)
    else:
        executor = LocalExecutor(ModelRunner(config, src.config, src.weights, size.num_blocks,
                                             size.max_model_len, src.blocks))
    facts = executor.facts()
    if facts.quant_kinds:
        log.info("quantization %s: %s; weights %.0f MiB", config.quantization,
                 ", ".join(f"{k}: {v}" for k, v in facts.quant_kinds.items()),
                 facts.weight_bytes / 2**20)
    return executor


def _size_gpu_cache(executor: Executor, config: EngineConfig, size: _Sizing) -> None:
    """Profile a full step, then give the KV cache what gpu_memory_utilization leaves."""
    num_blocks = executor.gpu_blocks(config.gpu_memory_utilization, size.block_bytes)
    if num_blocks < 1:
        raise DeviceError(f"the KV cache gpu_memory_utilization leaves holds no block of "
                          f"{size.block_bytes} bytes; raise --gpu-memory-utilization")
    bs = config.cache.block_size
    size.num_blocks = num_blocks
    size.max_model_len = min(size.model_len, num_blocks * bs)
    executor.allocate_kv(num_blocks, size.max_model_len)
    log.info("GPU KV cache: %.0f MiB (gpu_memory_utilization %g): %d blocks, %d tokens",
             num_blocks * size.block_bytes / 2**20, config.gpu_memory_utilization, num_blocks,
             num_blocks * bs)


# ---- the KV connector and the speculator ------------------------------------------------------

def _connector(config: EngineConfig, executor: Executor, fp: bytes,
               pool: BlockPool) -> KVExtension:
    tiers: TierConfig | None = config.kv_tiers
    if tiers is None:
        return KVExtension(NoKVConnector(), NoKVWorker(), pool)
    worker = executor.tier_worker(tiers, fp)  # under tensor parallel: a shard a rank
    kv = KVConnectorScheduler(worker.manager.descriptors(), config.cache.block_size,
                              worker.manager.layout.block_bytes, pool)
    worker.attach(kv.cost)
    log.info("KV tiers: %s%s (--kv-tiers none turns them off)", describe_tiers(tiers),
             ", a shard per tensor-parallel rank" if config.tensor_parallel_size > 1 else "")
    return KVExtension(kv, worker, pool)


def _draft_source(spec: SpeculativeConfig, target: ModelSource) -> ModelSource | None:
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


def _speculator(config: EngineConfig, spec: SpeculativeConfig, draft: ModelSource | None,
                device: DeviceChoice, pool: BlockPool, num_blocks: int,
                max_model_len: int) -> Speculator:
    def draft_proposer() -> DraftModelProposer:
        mode = "auto" if config.quantization in ("auto", *GGUF_MODES) else config.quantization
        native = device.type == "cpu" and fused_ops() is not None
        cfg = dataclasses.replace(
            config, model=spec.model, speculative_config=None, kv_tiers=None,
            sparse=SparseConfig(), cuda_graphs=False,
            # the draft keeps its blocks as the target does: an exact target, an exact draft
            quantization=resolve_quantization(mode, device.type, config.dtype,
                                              gguf_covers(draft.weights, draft.blocks), native,
                                              int8_dot=config.quantization == "gguf"))
        runner = ModelRunner(cfg, draft.config, draft.weights, num_blocks, max_model_len,
                             draft.blocks)
        return DraftModelProposer(runner, pool.num_blocks, config.cache.block_size,
                                  config.scheduler.max_num_batched_tokens)

    sparse, k = config.sparse, spec.num_speculative_tokens

    def may_speculate(req: Request) -> bool:
        """No grammar (its matcher advances one accepted token at a time), and a dense decode
        (a verify row attends densely; a sparse row would change its distribution)."""
        return req.params.structured_outputs is None and not (
            sparse.enabled and req.hints.sparse_attention is not False
            and req.num_tokens + k >= sparse.min_context)

    rows = spec.compute_bound_batch
    if rows is None:  # what the quantized kernels take from registers; a GPU: not measured
        rows = 64 if device.type == "cuda" else 8 if cpu_has("avx512f") else 4
    log.info("speculative decoding: %s; proposals fill a step up to %s rows", spec.describe(),
             rows or "any number of")
    return Speculator(spec, make_proposer(spec, draft_proposer), max_model_len, rows,
                      may_speculate)
