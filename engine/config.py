"""Frozen configuration values. No I/O here: a config can be built in a test without a model."""

from __future__ import annotations

import enum

import math
import re
from dataclasses import dataclass, field

from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.spec.config import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder, as read from a GGUF or a Hugging Face config.json. The family
    fixes what no field says: gemma3 scales the embedding by sqrt(hidden_size) (rounded to the
    compute dtype, as HF does), scales every RMSNorm by (1 + w), and norms the attention's and
    the MLP's outputs as well as their inputs (engine/worker/models/gemma3.py)."""

    architecture: str
    """Family name: llama, mistral, qwen2, qwen3 or gemma3."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP (SwiGLU, or GeGLU: hidden_act)."""
    num_layers: int
    """Decoder blocks."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA when fewer than num_heads)."""
    head_dim: int
    """Width of one attention head."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict | None = None
    """HF-style rope_scaling dict: rope_type linear, llama3 or yarn (engine.models.layers)."""
    max_position_embeddings: int = 4096
    """Longest context the model was trained for."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation unless ignore_eos is set."""
    hidden_act: str = "silu"
    """The MLP gate's activation, by HF's name: silu (SwiGLU, the Llama family) or
    gelu_pytorch_tanh (GeGLU: GELU's tanh approximation, Gemma 3)."""
    sliding_window: int | None = None
    """Keys a query of a windowed layer attends, itself included: a query at position p sees
    keys at (p - sliding_window, p] (Gemma 3: 512). None: no layer is windowed."""
    sliding_layers: tuple[int, ...] = ()
    """The layers that attend within sliding_window (HF's layer_types "sliding_attention"; Gemma
    3: five of every six, every sixth attends to the whole context)."""
    rope_local_base_freq: float | None = None
    """RoPE base of the windowed layers (Gemma 3: 10000; rope_theta, 1e6, and rope_scaling are
    the whole-context layers'). None: rope_theta on every layer."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma 3: 256 on most sizes,
    not always head_dim). None: head_dim ** -0.5."""

    @property
    def gqa_group(self) -> int:
        """Query heads that share one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """What attention multiplies q.k by (HF's `scaling`)."""
        if self.query_pre_attn_scalar is None:
            return 1.0 / math.sqrt(self.head_dim)
        return self.query_pre_attn_scalar ** -0.5

    @property
    def windowed(self) -> bool:
        """Some layer attends within a sliding window (the attention backend must take one)."""
        return self.sliding_window is not None and bool(self.sliding_layers)

    def window(self, layer: int) -> int | None:
        """The sliding window of this layer, or None: it attends to the whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    def kv_bytes_per_token(self, elem_size: int) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.kv_size * elem_size

    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token through every projection and the LM head (no attention)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i
        return 2 * (self.num_layers * per_layer + h * self.vocab_size)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the device KV cache (with sparse decode, the blocks' key summaries too); the
    block count follows from it. None: 1 GiB on the CPU; on a GPU, what gpu_memory_utilization
    leaves after the weights and a profiled step."""
    num_blocks: int | None = None
    """Exact block count; overrides kv_cache_memory_bytes when set."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained hash matches."""


class SchedulingPolicy(str, enum.Enum):
    """Which waiting request is admitted first (and which running one is preempted last)."""

    FCFS = "fcfs"
    """SLO class first (interactive, none, batch), then arrival."""
    PRIORITY = "priority"
    """The request's priority first (lower runs first), then SLO class, then arrival."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 512
    """Token budget of one step: decodes plus prefill chunks."""
    max_num_seqs: int = 64
    """Requests running at once."""
    max_model_len: int = 8192
    """Longest prompt plus output a request may reach."""
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    """fcfs or priority (a name is accepted: "priority")."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step (0: the whole budget)."""
    fair_share: bool = True
    """Share seats and each step's token budget across tenants (API keys), so one key's flood
    waits in its own queue (engine/core/fair_share.py); off, or a single tenant: first come."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        except ValueError:
            raise ValueError(f"policy: {self.policy!r} is not one of "
                             f"{', '.join(p.value for p in SchedulingPolicy)}") from None


@dataclass(frozen=True)
class SparseConfig:
    """Sparse top-k decode attention (Quest-style block selection; docs/sparse.md). Off unless
    topk_blocks or topk_ratio is set."""

    topk_blocks: int | None = None
    """KV blocks each decode query attends per KV head, the first and newest included."""
    topk_ratio: float | None = None
    """Or a fraction of the sequence's blocks (rounded up); topk_blocks wins when both are set."""
    min_context: int = 1024
    """Sequences with fewer context tokens attend densely."""
    dense_layers: int = 2
    """The first layers stay dense, as Quest does."""

    @property
    def enabled(self) -> bool:
        return self.topk_blocks is not None or self.topk_ratio is not None

    def topk(self, context_len: int, block_size: int) -> int | None:
        """Blocks this sequence attends (at most all of them), or None: dense (short context, or
        at most two blocks). The one-sequence form of engine.sparse.choose_rows."""
        blocks = -(-context_len // block_size)
        if not self.enabled or context_len < self.min_context or blocks <= 2:
            return None
        k = self.topk_blocks if self.topk_blocks is not None else math.ceil(self.topk_ratio * blocks)
        return min(blocks, max(2, k))  # the first and the newest block are always kept

    def validate(self) -> None:
        if self.topk_blocks is not None and self.topk_blocks < 2:
            raise ValueError(f"sparse topk_blocks must be >= 2 (the first and newest block are "
                             f"always attended); got {self.topk_blocks}")
        if self.topk_ratio is not None and not 0 < self.topk_ratio <= 1:
            raise ValueError(f"sparse topk_ratio must be in (0, 1]; got {self.topk_ratio}")
        if self.min_context < 0 or self.dense_layers < 0:
            raise ValueError("sparse min_context and dense_layers must be >= 0")


QUANTIZATIONS = ("none", "auto", "gguf", "gguf-exact", "int8", "int4")
"""The --quantization modes (engine/worker/quant.py)."""

GGUF_MODES = ("gguf", "gguf-exact")
"""The modes that keep a GGUF's own blocks (gguf: int8 activations on the Q4 blocks)."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, built from flags, YAML or keyword arguments."""

    model: str = "smollm2-135m"
    """Model name (an embedded alias), a .gguf file or a Hugging Face directory."""
    dtype: str = "auto"
    """Compute dtype of weights and activations: auto (bfloat16 on CUDA capability >= 8.0,
    float16 on older GPUs, float32 on the CPU), float32, float16 or bfloat16."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: 'auto' (the compute dtype), float32, float16 (fp16), bfloat16 (bf16) or
    fp8_e4m3 (one byte per value, stored as x / kv_cache_scale; halves KV bytes everywhere)."""
    kv_cache_scale: float = 1.0
    """Dequantization scale of an fp8_e4m3 KV cache (ignored for other KV dtypes)."""
    device: str = "auto"
    """auto (cuda:0 when torch sees a GPU, else cpu), cpu, cuda or cuda:N (engine.device)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's total memory this engine may use (weights, activations, KV cache);
    sizes the KV cache when kv_cache_memory_bytes is None. Ignored on the CPU."""
    seed: int = 0
    """Seed of the sampler for requests without a seed of their own."""
    attention_backend: str | None = None
    """Force an attention backend by name ('NAME', or 'prefill=NAME,decode=NAME'); None lets the
    router choose. A backend that cannot run this model here stops start-up with the reasons."""
    backend_profile: str | None = None
    """Backend timings written by `tierserve bench-backends`; None: ~/.cache/tierserve/."""
    num_threads: int | None = None
    """Torch intra-op threads; None uses the cores available to this process."""
    quantization: str = "auto"
    """Weight-only quantization (vLLM's flag): none (the serving dtype; a GGUF's blocks
    dequantized), gguf-exact (keep a GGUF's Q4_0 / Q4_1 / Q8_0 blocks as they are: the fp32
    path's outputs), gguf (the same blocks; activations rounded to int8 per block of 32 for
    integer dot products), int8 or int4 (groups of 32) from any weights; auto (the default):
    for a Q4 GGUF on the CPU in float32 where the native kernels are built, gguf on CPUs with
    AVX2, FMA and F16C and gguf-exact on others; else none (engine/worker/quant.py)."""
    prefill_bf16: bool = False
    """Prefill batches (64 tokens or more) multiply the decoder's linear layers in bf16 through
    oneDNN, which runs them on AMX's bf16 tiles (CPUs with amx_bf16 only; quantized weights are
    decoded first). Faster prefill, not the fp32 path's bits: off by default."""
    stack_decode_min_batch: int = 1
    """Decode-only steps of at least this many sequences run every layer in one native call
    (kernels/csrc/decode_forward.cpp); 0 keeps every step layer by layer. build_config takes it
    from TIERSERVE_STACK_DECODE_MIN_BATCH when not given."""
    cuda_graphs: bool = False
    """Replay decode-only steps from CUDA graphs captured at start-up, one per batch-size bucket
    and block-table width (engine/worker/cuda_graphs.py); needs a CUDA device and a decode backend with
    static metadata (triton). Elsewhere steps run eagerly, with a warning at start-up."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_tiers: TierConfig | None = None
    """KV tiers below the device cache (cpu, disk, s3); None: the device cache alone."""
    sparse: SparseConfig = field(default_factory=SparseConfig)
    """Sparse top-k decode attention (off by default)."""
    tensor_parallel_size: int = 1
    """Ranks the model is sharded over (vLLM's flag): worker processes joined by torch.distributed
    (gloo on the CPU, nccl on CUDA), each with a slice of every layer and of the KV cache
    (engine/worker/tp/); 1: the model runs in this process."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's --speculative-config): n-gram lookup or a draft model
    proposes tokens the model verifies in the same step (engine/spec/); None: off."""
    grammar_cache_bytes: int = 256 << 20
    """Bound of the compiled-grammar cache in bytes (least recently used out)."""
    grammar_max_bytes: int = 64 << 20
    """Largest compiled grammar (capped at grammar_cache_bytes); a larger one is refused."""
    grammar_compiles_per_key: int = 4
    """Large grammar compiles one cache scope (API key) may have queued or running."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value: str | int) -> int:
    """'512MiB' -> 536870912; plain integers pass through."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"not a byte size: {value!r} (examples: 1073741824, 512MiB, 2GiB)")
    unit = (m.group(2) or " ")[0].lower()
    return int(float(m.group(1)) * _UNITS.get(unit, 1))
