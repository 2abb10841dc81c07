"""The offline API in vLLM's shape: LLM(model=...).generate(prompts, params)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Sequence

from tierserve.engine.config import (CacheConfig, EngineConfig, SchedulerConfig, SparseConfig,
                                     parse_bytes)
from tierserve.engine.core.kv_hints import KVHints
from tierserve.engine.kv_tiers.config import TierConfig, default_cpu_bytes, default_disk_bytes
from tierserve.engine.llm_engine import LLMEngine
from tierserve.engine.outputs import RequestOutput
from tierserve.engine.sampling_params import SamplingParams
from tierserve.engine.spec.config import SpeculativeConfig
from tierserve.paths import cache_dir

_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHED_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}


# The flat names of the tier settings (flags, YAML keys, LLM(...) keywords) -> TierConfig fields.
TIER_ARGS = {"cpu_tier_bytes": "cpu_bytes", "disk_tier_dir": "disk_dir",
             "disk_tier_bytes": "disk_bytes", "s3_bucket": "s3_bucket", "s3_prefix": "s3_prefix",
             "s3_endpoint_url": "s3_endpoint_url", "s3_region": "s3_region",
             "kv_events_token_ids": "event_token_ids", "kv_load_timeout_s": "load_timeout_s",
             "disk_tier_error_backoff_s": "disk_error_backoff_s",
             "s3_connect_timeout_s": "s3_connect_timeout_s",
             "s3_read_timeout_s": "s3_read_timeout_s", "s3_max_attempts": "s3_max_attempts",
             "s3_probe_batch": "s3_probe_batch", "s3_create_bucket": "s3_create_bucket",
             "s3_breaker_threshold": "breaker_threshold",
             "s3_breaker_backoff_s": "breaker_backoff_s",
             "s3_breaker_max_backoff_s": "breaker_max_backoff_s",
             "kv_store_queue_depth": "store_queue_depth", "kv_store_workers": "store_workers",
             "kv_load_workers": "load_workers", "kv_event_log_size": "event_log_size"}

# The flat names of the sparse decode settings -> SparseConfig fields.
SPARSE_ARGS = {"sparse_topk_blocks": "topk_blocks", "sparse_topk_ratio": "topk_ratio",
               "sparse_min_context": "min_context", "sparse_dense_layers": "dense_layers"}


def build_config(**kwargs) -> EngineConfig:
    """EngineConfig from flat keyword arguments (block_size=..., max_num_seqs=..., ...)."""
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_FIELDS}
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHED_FIELDS}
    tiers = _tier_config(kwargs.pop("kv_tiers", None),
                         {TIER_ARGS[k]: kwargs.pop(k) for k in list(kwargs) if k in TIER_ARGS})
    flat = {SPARSE_ARGS[k]: kwargs.pop(k) for k in list(kwargs) if k in SPARSE_ARGS}
    sparse = {k: v for k, v in flat.items() if v is not None}
    if isinstance(kwargs.get("sparse"), SparseConfig):
        sparse = {**dataclasses.asdict(kwargs.pop("sparse")), **sparse}
    if "TIERSERVE_STACK_DECODE_MIN_BATCH" in os.environ:  # a tuning knob, read here, not at import
        kwargs.setdefault("stack_decode_min_batch",
                          int(os.environ["TIERSERVE_STACK_DECODE_MIN_BATCH"]))
    valid = {f.name for f in dataclasses.fields(EngineConfig)} - {"kv_tiers", "sparse"}
    unknown = set(kwargs) - valid
    if unknown:
        raise TypeError(f"unknown engine arguments {sorted(unknown)}; valid: "
                        f"{sorted(valid | _CACHE_FIELDS | _SCHED_FIELDS | set(TIER_ARGS) | set(SPARSE_ARGS))}")
    sparse_cfg = SparseConfig(**sparse)
    sparse_cfg.validate()
    if "speculative_config" in kwargs:  # JSON text, a dict or a SpeculativeConfig
        kwargs["speculative_config"] = SpeculativeConfig.parse(kwargs["speculative_config"])
    return EngineConfig(cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched),
                        kv_tiers=tiers, sparse=sparse_cfg, **kwargs)


def _tier_config(names: str | Sequence[str] | TierConfig | None, values: dict) -> TierConfig | None:
    """kv_tiers "cpu,disk" (or a list, or a whole TierConfig) plus the tier settings given; None,
    "" or "none" keeps the tiers off. Sizes left unset are bounded by the host: the cpu tier by
    its memory, the disk tier by the free space (kv_tiers.config)."""
    if isinstance(names, TierConfig):
        return dataclasses.replace(names, **{k: v for k, v in values.items() if v is not None})
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    values = {k: v for k, v in values.items() if v is not None}
    if not names or list(names) == ["none"]:
        return None
    for key in ("cpu_bytes", "disk_bytes"):
        if key in values:
            values[key] = parse_bytes(values[key])
    if "disk" in names and "disk_dir" not in values:
        values["disk_dir"] = cache_dir("kv")
    if "disk_dir" in values:
        values["disk_dir"] = os.path.expanduser(values["disk_dir"])
    if "cpu" in names:
        values.setdefault("cpu_bytes", default_cpu_bytes())
    if "disk" in names:
        values.setdefault("disk_bytes", default_disk_bytes(values["disk_dir"]))
    return TierConfig(tiers=tuple(names), **values)


class LLM:
    def __init__(self, model: str = "smollm2-135m", **kwargs):
        self.engine = LLMEngine(build_config(model=model, **kwargs))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 kv_hints: KVHints | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; n > 1 gives n outputs per prompt.
        kv_hints steer the KV tiers for every prompt (tierserve.engine.core.kv_hints.KVHints)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        for p in plist:  # a grammar the compiler refuses raises here (GrammarError)
            if p.structured_outputs is not None:
                self.engine.compile_grammar(p.structured_outputs).result()
        groups: list[tuple[str, list[str]]] = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            base = str(self._next_id)
            self._next_id += 1
            children = []
            for j in range(p.n):
                child = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + j)
                cid = f"{base}-{j}"
                self.engine.add_request(cid, prompt, child, priority=priority[i] if priority else 0,
                                        kv_hints=kv_hints)
                children.append(cid)
            groups.append((base, children))
        done = self._run(use_tqdm)
        results = []
        for base, children in groups:
            outs = [done[c] for c in children]
            first = outs[0]
            comps = []
            for j, o in enumerate(outs):
                c = o.outputs[0]
                c.index = j
                comps.append(c)
            results.append(dataclasses.replace(first, request_id=base, outputs=comps))
        return results

    def _run(self, use_tqdm: bool) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        total = self.engine.scheduler.num_unfinished
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.finished:
                    done[o.request_id] = o
                    if use_tqdm:
                        print(f"\r{len(done)}/{total} requests done", end="", file=sys.stderr)
        if use_tqdm:
            print(file=sys.stderr)
        return done
