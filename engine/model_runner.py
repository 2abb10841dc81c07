"""Runs one scheduled step: builds the flat batch into fixed-capacity buffers, runs the model under
the forward context, samples. Owns the model, the KV cache tensors and the attention backend."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from tierserve.engine.batch_buffers import BatchBuffers
from tierserve.engine.config import EngineConfig, ModelConfig
from tierserve.engine.cuda_graphs import RESERVED_BLOCKS, DecodeGraphs, wants_graphs
from tierserve.engine.models import model_class
from tierserve.engine.request import Request, RequestId
from tierserve.engine.sampler import SampleRow, Sampler, TopLogprobs, gather_logprobs
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from tierserve.engine.sparse import SparseDecoder
from tierserve.kernels import AttentionBackend, BatchLayout, ForwardContext, create_backend, forward_context
from tierserve.kernels.composite import PhaseSplit
from tierserve.kernels.kv_dtype import kv_torch_dtype
from tierserve.kernels.native import fused_ops
from tierserve.kernels.profile import load_profile
from tierserve.kernels.router import Route, RouteQuery, describe, route_phases

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepResult:
    sampled: dict[RequestId, int]
    logprobs: dict[RequestId, TopLogprobs]
    prompt_logprobs: dict[RequestId, list[TopLogprobs]]
    """Per request, logprobs of prompt tokens computed this step, in position order."""
    table_width: int = 0
    """Width of this step's block-table view, in blocks (engine.batch_buffers)."""
    metadata_bytes: int = 0
    """Bytes of the step's metadata views: block tables, slots, context lengths, sparse picks."""
    metadata_seconds: float = 0.0
    """Time to build the step's inputs and the backend's metadata."""


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 num_blocks: int, max_model_len: int):
        self.config = config
        self.model_cfg = model_cfg
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = kv_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.model = self._build_model(weights)
        self.routes, self.backend = self._choose_backend()
        if config.sparse.enabled and not self.backend.capabilities.sparse:
            log.warning("sparse decode is on, but the decode backend %s cannot run it: decodes "
                        "attend densely (see `tierserve route`)", self.backend.name)
        self.native = fused_ops() if self.device.type == "cpu" and self.dtype == torch.float32 else None
        self.sparse = SparseDecoder(config.sparse, model_cfg.num_layers, model_cfg.num_kv_heads,
                                    model_cfg.head_dim, self.block_size, self.device,
                                    self.native)
        self.allocate_kv(num_blocks, max_model_len)
        self.model.use_native_ops(self.native)  # also packs the linear weights for their kernel
        self.sampler = Sampler(config.seed, argmax=self.native.argmax_rows if self.native else None)
        self.eos_ids = tuple(model_cfg.eos_token_ids)
        self._uploaded = torch.cuda.Event() if self.device.type == "cuda" else None
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
        if self.config.sparse.enabled:
            self.sparse.allocate(num_blocks)
        sc = self.config.scheduler
        # Fixed-capacity host buffers (pinned on a GPU); each step uses views as wide as its batch.
        self.buffers = BatchBuffers(sc.max_num_seqs, sc.max_num_batched_tokens,
                                    -(-max_model_len // self.block_size), mc.num_kv_heads,
                                    pin_memory=self.device.type == "cuda")

    def capture_graphs(self, pool_blocks: int) -> None:
        """Capture the decode graphs against the final KV cache, once, at start-up."""
        if not self.graph_reserved_blocks:
            return
        t0 = time.perf_counter()
        sparse = self.sparse if self.config.sparse.enabled and self.backend.capabilities.sparse \
            else None
        graphs = DecodeGraphs(self.model, self.backend, self.device,
                              self.config.scheduler.max_num_seqs, self.buffers.capacity,
                              self.block_size, sparse=sparse)
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

    def _build_model(self, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = model_class(self.model_cfg.architecture)(self.model_cfg, self.max_model_len)
        model.load_weights(weights)
        for p in model.parameters():  # buffers (the RoPE table) stay fp32
            p.data = p.data.to(device=self.device, dtype=self.dtype)
        return model.to(self.device).eval()

    def _choose_backend(self) -> tuple[dict[str, Route], AttentionBackend]:
        """Route prefill and decode separately: one backend when both agree, else a PhaseSplit."""
        mc = self.model_cfg
        cap = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        q = RouteQuery(self.device.type, self.dtype, self.config.kv_cache_dtype, mc.head_dim,
                       mc.num_heads, mc.num_kv_heads, self.block_size, capability=cap)
        routes = route_phases(q, self.config.attention_backend,
                              load_profile(self.config.backend_profile),
                              sparse_decode=self.config.sparse.enabled)
        built: dict[str, AttentionBackend] = {}  # routed name -> instance (maybe a fallback)
        for r in routes.values():
            if r.backend not in built:
                built[r.backend] = self._create_backend(r)
        pre, dec = (built[routes[p].backend] for p in ("prefill", "decode"))
        for r, be in ((routes["prefill"], pre), (routes["decode"], dec)):
            if be.name != r.backend:  # the routed backend failed to build
                r.rejected.pop(be.name, None)
                r.rejected[r.backend] = getattr(be, "fallback_reason", "failed to build")
                r.backend = be.name
        log.info("attention backends:\n%s", describe(routes))
        return routes, dec if pre is dec else PhaseSplit(prefill=pre, decode=dec)

    def _create_backend(self, r: Route) -> AttentionBackend:
        mc = self.model_cfg
        args = (mc.num_heads, mc.num_kv_heads, mc.head_dim, 1.0 / math.sqrt(mc.head_dim))
        kw = dict(kv_scale=self.config.kv_cache_scale, device=self.device, dtype=self.dtype,
                  kv_dtype=self.kv_dtype)
        try:
            return create_backend(r.backend, *args, **kw)
        except RuntimeError as e:  # e.g. a native kernel that failed to build
            if self.config.attention_backend:
                raise
            fallback = "torch_sdpa"
            log.warning("attention backend %s unavailable (%s); using %s", r.backend, e, fallback)
            be = create_backend(fallback, *args, **kw)
            be.fallback_reason = str(e)
            return be

    @property
    def kv_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    # ---- whole KV blocks, for the tiers ----------------------------------------------------------

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's KV for every layer: [layers, 2 (K, V), kv heads, block size, head dim]."""
        mc = self.model_cfg
        return (mc.num_layers, 2, mc.num_kv_heads, self.block_size, mc.head_dim)

    def _blocks_view(self, cache: torch.Tensor) -> torch.Tensor:
        """[2, H, slots, D] -> [2, H, num_blocks, block size, D] (no copy)."""
        two, h, _, d = cache.shape
        return cache.view(two, h, self.num_blocks, self.block_size, d)

    @torch.inference_mode()
    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copies of these blocks' KV, [n, layers, 2, H, block size, D], on the host: one
        index_select per layer for all blocks together."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        per_layer = [self._blocks_view(c).index_select(2, idx) for c in self.kv_caches]
        return torch.stack(per_layer).permute(3, 0, 1, 2, 4, 5).contiguous().cpu()

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write [n, layers, 2, H, block size, D] into these device blocks (between steps)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = blocks.to(device=self.device, dtype=self.kv_dtype).permute(1, 2, 3, 0, 4, 5)
        for cache, layer in zip(self.kv_caches, data):
            self._blocks_view(cache).index_copy_(2, idx, layer)
        self.sparse.rebuild(self.kv_caches, block_ids)

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        hidden, layout, sample_rows, facts = self._forward(out)
        prompt_lps = self._prompt_logprobs(out, hidden, layout)
        if not sample_rows:
            return StepResult({}, {}, prompt_lps, **facts)
        # The sampler runs where the logits are; only token ids (and asked logprobs) come back.
        logits = self._logits(hidden, layout, sample_rows)
        reqs = [out.scheduled[i].request for i in sample_rows]
        rows = [SampleRow(r.params, r.prompt_token_ids, r.output_token_ids,
                          self._stop_ids(r.params)) for r in reqs]
        res = self.sampler(logits, rows)
        sampled = {r.request_id: tok for r, tok in zip(reqs, res.token_ids)}
        lps = {r.request_id: lp for r, lp in zip(reqs, res.logprobs) if lp is not None}
        return StepResult(sampled, lps, prompt_lps, **facts)

    @torch.inference_mode()
    def logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step and return the float32 logits of each sampling request's last token
        (no sampling, no state change beyond the KV written): for evaluation, e.g. teacher-forced
        agreement of sparse and dense decode."""
        hidden, layout, sample_rows, _ = self._forward(out)
        return self._logits(hidden, layout, sample_rows)

    def _forward(self, out: SchedulerOutput):
        """The model over the step's tokens: (hidden, layout, rows that sample, metadata facts)."""
        t0 = time.perf_counter()
        layout, sample_rows = self._layout(out)
        if self.graphs is not None and self.graphs.can_replay(layout):
            sparse = (self.sparse.plan([s.request for s in out.scheduled], layout, self.buffers)
                      if self.graphs.sparse is not None else None)
            topk = self.buffers.topk.numpy()[:layout.num_seqs] if sparse is not None else None
            hidden, nbytes = self.graphs.replay(layout, self.buffers, topk)
            self.sparse.update(self.kv_caches, layout.slot_mapping)
            if self._uploaded is not None:
                self._uploaded.record()  # the plan's and the update's copies out of the buffers
            if sparse is not None:
                self.sparse.collect()
            return hidden, layout, sample_rows, dict(
                table_width=layout.block_tables.shape[1], metadata_bytes=nbytes,
                metadata_seconds=time.perf_counter() - t0)
        t = out.num_batched_tokens
        dev, b = self.device, self.buffers
        sparse = (self.sparse.plan([s.request for s in out.scheduled], layout, self.buffers)
                  if self.backend.capabilities.sparse else None)
        slots = layout.slot_mapping.to(dev, non_blocking=True)  # once per step, not per layer
        ctx = ForwardContext(self.backend, self.backend.build_metadata(layout), slots,
                             self.kv_caches, sparse)
        tokens, positions = (b.tokens[:t].to(dev, non_blocking=True),
                             b.positions[:t].to(dev, non_blocking=True))
        if self._uploaded is not None:
            self._uploaded.record()  # after every copy out of the pinned buffers
        views = (layout.block_tables, layout.slot_mapping, self.buffers.context_lens[:layout.num_seqs],
                 *((sparse.topk, sparse.selected) if sparse else ()))
        facts = dict(table_width=layout.block_tables.shape[1], metadata_bytes=BatchBuffers.nbytes(*views),
                     metadata_seconds=time.perf_counter() - t0)
        with forward_context(ctx):
            hidden = self.model(tokens, positions)
        self.sparse.update(self.kv_caches, slots)
        if sparse is not None:
            self.sparse.collect()
        return hidden, layout, sample_rows, facts

    def _logits(self, hidden: torch.Tensor, layout: BatchLayout, rows: list[int]) -> torch.Tensor:
        idx = torch.tensor([layout.query_start[i + 1] - 1 for i in rows], device=self.device)
        return self.model.compute_logits(hidden[idx]).float()

    def _stop_ids(self, params) -> tuple[int, ...]:
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_ids)

    def _layout(self, out: SchedulerOutput) -> tuple[BatchLayout, list[int]]:
        """The step's tokens, positions, slots and block tables, written into the fixed buffers
        (numpy views of their memory: no tensor is allocated)."""
        sched, buf, bs = out.scheduled, self.buffers, self.block_size
        if self._uploaded is not None:
            # The previous step's asynchronous copies read these pinned buffers when they run;
            # a step that did not sample never waited for them (a sampling step syncs anyway).
            self._uploaded.synchronize()
        qlens = np.fromiter((s.num_new_tokens for s in sched), dtype=np.int64, count=len(sched))
        starts = np.fromiter((s.start for s in sched), dtype=np.int64, count=len(sched))
        qstart = np.zeros(len(sched) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qstart[1:])
        t = int(qstart[-1])
        tokens = buf.tokens.numpy()
        for s, a in zip(sched, qstart.tolist()):
            tokens[a:a + s.num_new_tokens] = s.request.token_slice(s.start, s.start + s.num_new_tokens)
        tables = buf.table_view([s.block_ids for s in sched])
        seq = np.repeat(np.arange(len(sched)), qlens)
        pos = buf.positions.numpy()[:t]
        np.add(np.arange(t) - qstart[:-1][seq], starts[seq], out=pos)
        slots = buf.slot_mapping.numpy()[:t]
        np.add(tables.numpy()[seq, pos // bs] * bs, pos % bs, out=slots)
        ctx_lens = starts + qlens
        buf.context_lens.numpy()[:len(sched)] = ctx_lens
        num_decodes = next((i for i, q in enumerate(qlens.tolist()) if q != 1), len(sched))
        layout = BatchLayout(num_decodes, qlens.tolist(), ctx_lens.tolist(), qstart.tolist(),
                             tables, buf.slot_mapping[:t], bs)
        return layout, [i for i, s in enumerate(sched) if s.samples]

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor,
                         layout: BatchLayout) -> dict[RequestId, list[TopLogprobs]]:
        res: dict[RequestId, list[TopLogprobs]] = {}
        for i, s in enumerate(out.scheduled):
            r = s.request
            n = r.params.prompt_logprobs
            end = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1)
            if n is None or s.start >= end:
                continue
            # hidden at position p predicts token p + 1
            rows = hidden[layout.query_start[i]:layout.query_start[i] + end - s.start]
            lp = torch.log_softmax(self.model.compute_logits(rows), dim=-1).cpu()
            nxt = torch.tensor(r.prompt_token_ids[s.start + 1:end + 1])
            res[r.request_id] = gather_logprobs(lp, nxt, [n] * len(nxt))
        return res

