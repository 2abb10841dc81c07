"""Runs one scheduled step. Owns the model, the KV cache tensors and the attention backend.

One path for every step, each part written once: the layout (the step's inputs in the fixed
buffers; sparse.prepare plans its decodes), the upload (a decode graph's static inputs when one
fits the step, else the eager inputs and the backend's metadata), the run (graph replay or eager
forward; then sparse.after_step), the collect (logits, sampler, prompt logprobs). Sparse decode
stays behind engine/worker/sparse.py's hooks, which do nothing without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from tierserve.engine.worker.backend_choice import choose_backend
from tierserve.engine.worker.batch_buffers import BatchBuffers, StepInputs, query_rows, upload_event
from tierserve.engine.config import EngineConfig, ModelConfig
from tierserve.engine.worker.cuda_graphs import RESERVED_BLOCKS, DecodeGraphs, wants_graphs
from tierserve.engine.worker.kv_blocks import gather_blocks, write_blocks
from tierserve.engine.worker.models import model_class
from tierserve.engine.worker.models.llama import ParallelContext
from tierserve.engine.worker.quant import quantize_model, taken_from_blocks, weight_bytes
from tierserve.engine.core.request import Request, RequestId
from tierserve.engine.outputs import TopLogprobs
from tierserve.engine.worker.sampler import SampleRow, Sampler, gather_logprobs
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.spec.verify import AcceptRule, accepted_prefix
from tierserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from tierserve.engine.worker.sparse import decode_sparsity, step_bytes
from tierserve.kernels import BatchLayout, ForwardContext, forward_context
from tierserve.kernels.kv_dtype import kv_torch_dtype
from tierserve.kernels.native import fused_ops
from tierserve.kernels.sparse_plan import SparseStep

log = logging.getLogger(__name__)

Constrain = Callable[[torch.Tensor, list[RequestId]], None]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PREFILL_BF16_MIN_ROWS = 64
"""--prefill-bf16: batches of at least this many tokens take the bf16 GEMMs."""


@dataclass
class StepResult:
    sampled: dict[RequestId, list[int]]
    """Per sampling request, the tokens it keeps: one, or a verified row's accepted proposals and
    the target's next token."""
    logprobs: dict[RequestId, list[TopLogprobs]]
    """Per request that asked, one entry per kept token."""
    prompt_logprobs: dict[RequestId, list[TopLogprobs]]
    """Per request, logprobs of prompt tokens computed this step, in position order."""
    table_width: int = 0
    """Width of this step's block-table view, in blocks (engine.batch_buffers)."""
    metadata_bytes: int = 0
    """Bytes of the step's metadata views: block tables, slots, context lengths, sparse picks."""
    metadata_seconds: float = 0.0
    """Time to build the step's inputs and the backend's metadata."""


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                 num_blocks: int, max_model_len: int, blocks: dict | None = None,
                 tp: ParallelContext | None = None):
        """`tp`: a tensor-parallel rank's collectives (engine/worker/tp/shard.py), given to the
        model as it is built; `model_cfg` and `weights` are then the rank's shard."""
        self.config = config
        self.tp = tp
        self.model_cfg = model_cfg
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = kv_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.quant_kinds: dict[str, str] = {}
        """Which kernel each kind of layer runs under --quantization (empty: none)."""
        self.native = fused_ops() if self.device.type == "cpu" and self.dtype == torch.float32 else None
        self.model = self._build_model(weights, blocks or {})
        self.routes, self.backend = choose_backend(config, model_cfg, self.device, self.dtype,
                                                   self.kv_dtype)
        if config.prefill_bf16:  # prefill attention in bf16 too (AMX), where SDPA runs it
            for b in (self.backend, getattr(self.backend, "prefill", None)):
                if hasattr(b, "prefill_bf16_min_rows"):
                    b.prefill_bf16_min_rows = PREFILL_BF16_MIN_ROWS
        self.sparse = decode_sparsity(config.sparse, self.backend, model_cfg, self.block_size,
                                      self.device, self.native)
        self.allocate_kv(num_blocks, max_model_len)
        self.model.use_native_ops(self.native)  # also packs the linear weights for their kernel
        self.sampler = Sampler(config.seed, argmax=self.native.argmax_rows if self.native else None)
        self.eos_ids = tuple(model_cfg.eos_token_ids)
        self._said_verify_mode = False
        self.accept: AcceptRule = accepted_prefix
        """Speculative decoding's acceptance rule (engine/spec/verify.py)."""
        self._uploaded = upload_event(self.device)
        """Recorded after a step's copies out of the pinned host buffers; the next step's layout
        waits for it before writing them."""
        self.graphs: DecodeGraphs | None = None
        """Decode CUDA graphs, captured by capture_graphs() once the KV cache has its final size."""
        wanted = wants_graphs(config, self.device, self.backend)  # warns when refused
        self.graph_reserved_blocks = RESERVED_BLOCKS if wanted else 0
        """KV blocks the engine keeps out of the pool: the graphs' scratch block (the cache's last)."""

    def allocate_kv(self, num_blocks: int, max_model_len: int) -> None:
        """(Re)allocate the KV cache and the block-table buffer. The engine calls it again on a
        GPU once profiling has sized the cache; the model's RoPE table keeps its first length,
        which is never shorter than max_model_len."""
        mc = self.model_cfg
        self.graphs = None  # they were captured against the old cache
        self.kv_caches = []  # free the old cache before the new one is allocated
        self.num_blocks, self.max_model_len = num_blocks, max_model_len
        slots = num_blocks * self.block_size
        self.kv_caches = [torch.zeros(2, mc.num_kv_heads, slots, mc.head_dim,
                                      dtype=self.kv_dtype, device=self.device)
                          for _ in range(mc.num_layers)]
        self.sparse.allocate(num_blocks)
        sc = self.config.scheduler
        # Fixed-capacity host buffers (pinned on a GPU; the sparse picks on the device); each step
        # uses views as wide as its batch.
        # A verified decode takes 1 + k rows (batch_buffers.query_rows).
        spec = self.config.speculative_config
        rows = sc.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        self.buffers = BatchBuffers(rows, sc.max_num_batched_tokens,
                                    -(-max_model_len // self.block_size), mc.num_kv_heads,
                                    pin_memory=self.device.type == "cuda", device=self.device)

    def capture_graphs(self, pool_blocks: int) -> None:
        """Capture the decode graphs against the final KV cache, once, at start-up."""
        if not self.graph_reserved_blocks:
            return
        t0 = time.perf_counter()
        graphs = DecodeGraphs(self.model, self.backend, self.device,
                              self.config.scheduler.max_num_seqs, self.buffers.capacity,
                              self.block_size, sparse=self.sparse)
        graphs.capture(self.kv_caches, self.num_blocks - 1, pool_blocks)
        self.graphs = graphs
        log.info("decode CUDA graphs: %d (batch buckets %s x table widths %s) in %.1f s",
                 graphs.num_graphs, graphs.buckets, graphs.widths, time.perf_counter() - t0)

    def profile_activation_peak(self) -> int:
        """Peak CUDA bytes allocated by one step of max_num_batched_tokens prompt tokens, above
        what was allocated before it (weights, KV cache). Needs a cache of at least
        ceil(max_num_batched_tokens / block_size) blocks."""
        t = self.config.scheduler.max_num_batched_tokens
        blocks = tuple(range(-(-t // self.block_size)))
        req = Request(RequestId("profile"), [0] * t, SamplingParams(max_tokens=1), 1)
        out = SchedulerOutput((ScheduledRequest(req, 0, t, blocks, True),), t)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.execute(out)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def _build_model(self, weights: Mapping[str, torch.Tensor], blocks: dict) -> torch.nn.Module:
        """Parameters are created empty where they run, in the serving dtype, and each checkpoint
        tensor is copied straight in (a safetensors tensor read from its file then): the host
        holds one checkpoint tensor at a time beside the weights. Quantization starts from fp32
        weights on the host (engine/worker/quant.py packs those), except for what gguf mode takes
        from the file's own blocks (never read in fp32: taken_from_blocks), then moves the rest."""
        quantized = self.config.quantization != "none"
        with torch.device("meta"):
            model = model_class(self.model_cfg.architecture)(self.model_cfg, self.max_model_len,
                                                             self.tp)
        _empty_parameters(model, torch.device("cpu") if quantized else self.device,
                          torch.float32 if quantized else self.dtype)
        model.stack_decode_min_batch = self.config.stack_decode_min_batch
        if self.config.prefill_bf16:
            model.use_bf16_prefill(PREFILL_BF16_MIN_ROWS)
        model.load_weights(weights, taken_from_blocks(self.config.quantization, model, blocks))
        if self.config.quantization != "none":
            self.quant_kinds = quantize_model(model, self.config.quantization, blocks,
                                              native=self.native is not None,
                                              device=self.device, dtype=self.dtype)
        for p in model.parameters():  # buffers (the RoPE table) stay fp32
            p.data = p.data.to(device=self.device, dtype=self.dtype)
        return model.to(self.device).eval()

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold on the device (quantized or not)."""
        return weight_bytes(self.model)

    @property
    def kv_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    # ---- whole KV blocks, for the tiers ----------------------------------------------------------

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's KV for every layer: [layers, 2 (K, V), kv heads, block size, head dim]."""
        mc = self.model_cfg
        return (mc.num_layers, 2, mc.num_kv_heads, self.block_size, mc.head_dim)

    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copies of these blocks' KV, [n, *block_shape], on the host (engine/worker/kv_blocks.py)."""
        return gather_blocks(self.kv_caches, block_ids, self.block_size)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write [n, *block_shape] into these device blocks (between steps)."""
        write_blocks(self.kv_caches, block_ids, blocks, self.block_size)
        self.sparse.rebuild(self.kv_caches, block_ids)

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, constrain: Constrain | None = None) -> StepResult:
        """Run the step and sample. `constrain(logits, request_ids)` masks the sampling rows'
        logits in place first (structured outputs: engine/worker/grammar.py)."""
        hidden, layout, sample_rows, facts = self._forward(out)
        prompt_lps = self._prompt_logprobs(out, hidden, layout)
        if not sample_rows:
            return StepResult({}, {}, prompt_lps, **facts)
        # The sampler runs where the logits are; only token ids (and asked logprobs) come back.
        logits = self._logits(hidden, layout, sample_rows, out)
        rows = self._sample_rows(out, sample_rows)
        if constrain is not None:
            constrain(logits, [r.request_id for r in rows])
        res = self.sampler(logits, rows)
        sampled, lps, at = {}, {}, 0
        for i in sample_rows:
            s, r = out.scheduled[i], out.scheduled[i].request
            k = len(s.spec_token_ids)
            draws = res.token_ids[at:at + k + 1]
            n = self.accept(s.spec_token_ids, draws) if k else 0
            sampled[r.request_id] = list(s.spec_token_ids[:n]) + [draws[n]]
            if r.params.logprobs is not None:
                lps[r.request_id] = res.logprobs[at:at + n + 1]
            at += k + 1
        return StepResult(sampled, lps, prompt_lps, **facts)

    @torch.inference_mode()
    def logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step and return the float32 logits of each sampling request's last token
        (no sampling, no state change beyond the KV written): for evaluation, e.g. teacher-forced
        agreement of sparse and dense decode."""
        hidden, layout, sample_rows, _ = self._forward(out)
        return self._logits(hidden, layout, sample_rows, out)

    def _forward(self, out: SchedulerOutput):
        """The model over the step's tokens: (hidden, layout, rows that sample, metadata facts).
        A graph replay and an eager forward differ only in how the inputs reach the device."""
        t0 = time.perf_counter()
        layout, sample_rows = self._layout(out)
        plan = self.sparse.prepare(tuple(s for s, _, _ in query_rows(out.scheduled)), layout,
                                   self.buffers)
        replay = self.graphs is not None and self.graphs.can_replay(layout)
        if self.graphs is not None and not self._said_verify_mode:
            self._say_verify_mode(out, layout, replay)
        inputs = (self.graphs.upload(layout, self.buffers, plan) if replay
                  else self._upload(out, layout, plan))
        self._uploaded.record()  # after every copy out of the pinned buffers
        facts = dict(table_width=layout.block_tables.shape[1], metadata_bytes=inputs.nbytes,
                     metadata_seconds=time.perf_counter() - t0)
        hidden = inputs.run()
        self.sparse.after_step(self.kv_caches, inputs.slots, plan)
        return hidden, layout, sample_rows, facts

    def _say_verify_mode(self, out: SchedulerOutput, layout: BatchLayout, replay: bool) -> None:
        """Log, once, how the first step with verified (speculative) rows ran under CUDA graphs."""
        if any(s.spec_token_ids for s in out.scheduled):
            self._said_verify_mode = True
            log.info("speculative verification: a step of %d rows (%d decode rows) %s",
                     layout.num_seqs, layout.num_decodes, "replayed a captured decode graph" if replay else
                     "ran eagerly (no captured graph fits it: a prefill in the step, or more rows "
                     "or a wider block table than any graph)")

    def _upload(self, out: SchedulerOutput, layout: BatchLayout,
                plan: SparseStep | None) -> StepInputs:
        """The eager step: its inputs on the device and the backend's metadata over them."""
        t, dev, b = out.num_batched_tokens, self.device, self.buffers
        slots = layout.slot_mapping.to(dev, non_blocking=True)  # once per step, not per layer
        ctx = ForwardContext(self.backend, self.backend.build_metadata(layout), slots,
                             self.kv_caches, plan)
        tokens, positions = (b.tokens[:t].to(dev, non_blocking=True),
                             b.positions[:t].to(dev, non_blocking=True))

        def run() -> torch.Tensor:
            with forward_context(ctx):
                return self.model(tokens, positions)
        nbytes = BatchBuffers.nbytes(layout.block_tables, layout.slot_mapping,
                                     b.context_lens[:layout.num_seqs]) + step_bytes(plan)
        return StepInputs(run, slots, nbytes)

    def _logits(self, hidden: torch.Tensor, layout: BatchLayout, rows: list[int],
                out: SchedulerOutput) -> torch.Tensor:
        """Logits of each sampling row's last token; a verified row's 1 + k last positions."""
        ends = _token_ends(out)
        idx = [j for i in rows
               for j in range(ends[i] - 1 - len(out.scheduled[i].spec_token_ids), ends[i])]
        return self.model.compute_logits(hidden[torch.tensor(idx, device=self.device)]).float()

    def _sample_rows(self, out: SchedulerOutput, sample_rows: list[int]) -> list[SampleRow]:
        """One row per logits row; position j of a verified row sees the first j proposals as
        output (penalties, min_tokens and the seeded draw at that index)."""
        rows = []
        for i in sample_rows:
            s, r = out.scheduled[i], out.scheduled[i].request
            stop = self._stop_ids(r.params)
            rows.append(SampleRow(r.params, r.prompt_token_ids, r.output_token_ids, stop,
                                  r.request_id))
            for j in range(1, len(s.spec_token_ids) + 1):
                rows.append(SampleRow(r.params, r.prompt_token_ids,
                                      r.output_token_ids + list(s.spec_token_ids[:j]), stop,
                                      r.request_id))
        return rows

    def _stop_ids(self, params) -> tuple[int, ...]:
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_ids)

    def _layout(self, out: SchedulerOutput) -> tuple[BatchLayout, list[int]]:
        """The step written into the fixed buffers: (its layout, the rows that sample)."""
        # The previous step's asynchronous copies read these pinned buffers when they run; a step
        # that did not sample never waited for them (a sampling step syncs anyway).
        self._uploaded.synchronize()
        return self.buffers.write_step(out.scheduled, self.block_size)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor,
                         layout: BatchLayout) -> dict[RequestId, list[TopLogprobs]]:
        res: dict[RequestId, list[TopLogprobs]] = {}
        ends = _token_ends(out)
        for i, s in enumerate(out.scheduled):
            r = s.request
            n = r.params.prompt_logprobs
            end = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1)
            if n is None or s.start >= end:
                continue
            # hidden at position p predicts token p + 1
            first = ends[i] - s.num_new_tokens
            rows = hidden[first:first + end - s.start]
            lp = torch.log_softmax(self.model.compute_logits(rows), dim=-1).cpu()
            nxt = torch.tensor(r.prompt_token_ids[s.start + 1:end + 1])
            res[r.request_id] = gather_logprobs(lp, nxt, [n] * len(nxt))
        return res



def _token_ends(out: SchedulerOutput) -> list[int]:
    """Where each scheduled request's tokens end in the step's flat batch (exclusive)."""
    ends, at = [], 0
    for s in out.scheduled:
        at += s.num_new_tokens
        ends.append(at)
    return ends


def _empty_parameters(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give a model built on the meta device empty parameters on `device` in `dtype`, for
    load_weights to fill (every parameter is a checkpoint tensor). Buffers are left alone."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype),
                                                     requires_grad=False))
