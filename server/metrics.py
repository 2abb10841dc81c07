"""Prometheus metrics with vLLM's names where they exist (vllm:*), tierserve's own otherwise.

Engine counters and gauges are read from the loop thread's latest EngineSnapshot at scrape time
(a custom collector), so the engine thread never touches prometheus objects. Latency histograms
are observed on the event loop as outputs arrive."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                   HistogramMetricFamily, Metric)

from tierserve.engine.api import (COMPILE_BUCKETS, LATENCY_BUCKETS, EngineInfo, EngineSnapshot,
                                  GrammarStats, HistogramSnapshot, RequestOutput, SpecStats)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0)


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model: str):
        self.snapshot, self.model = snapshot, model

    def collect(self) -> Iterable[Metric]:
        s, lbl = self.snapshot(), [self.model]
        yield _gauge("vllm:num_requests_running", "Requests in the model execution batch.", s.num_running, lbl)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting, lbl)
        yield _gauge("tierserve:engine_requests_tracked", "Requests the engine holds state for "
                     "(admitted, not finished); 0 when idle.", s.num_tracked, lbl)
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", s.kv_usage, lbl)
        yield _gauge("tierserve:kv_cache_blocks_total", "KV blocks in the device pool.", s.num_blocks, lbl)
        yield _gauge("tierserve:kv_cache_blocks_free", "Free KV blocks in the device pool.", s.num_free_blocks, lbl)
        yield _counter("vllm:prefix_cache_queries", "Prefix-cache block lookups.", s.prefix_queries, lbl)
        yield _counter("vllm:prefix_cache_hits", "Prefix-cache block hits.", s.prefix_hits, lbl)
        yield _counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens, lbl)
        yield _counter("vllm:generation_tokens", "Generation tokens processed.", s.generation_tokens, lbl)
        yield _counter("tierserve:engine_steps", "Engine steps run.", s.steps, lbl)
        yield _counter("vllm:num_preemptions", "Preemptions of running requests.",
                       s.num_preemptions, lbl)
        yield _histogram("vllm:iteration_tokens_total", "Tokens run per engine step.",
                         s.iteration_tokens, lbl)
        yield _histogram("tierserve:block_table_width", "Block-table width per step, in blocks "
                         "(a power of two: the width rule of engine/worker/batch_buffers.py).",
                         s.table_width, lbl)
        yield _histogram("tierserve:step_metadata_bytes", "Bytes of metadata views per step.",
                         s.metadata_bytes, lbl)
        yield _counter("tierserve:step_metadata_seconds", "Time building step inputs and "
                       "attention metadata.", s.metadata_seconds, lbl)
        sp = s.sparse
        yield _counter("tierserve:sparse_decode_steps", "Steps with sparse decodes.", sp.steps, lbl)
        yield _counter("tierserve:sparse_blocks_attended", "KV blocks sparse decodes attended "
                       "(per KV head and sparse layer).", sp.blocks_attended, lbl)
        yield _counter("tierserve:sparse_blocks_dense", "KV blocks dense attention would have "
                       "read for the same decodes; attended / dense is the fraction attended.",
                       sp.blocks_total, lbl)
        yield _counter("tierserve:sparse_selection_seconds", "Time scoring and choosing blocks "
                       "(summed over kernel threads).", sp.selection_seconds, lbl)
        yield from _grammar(s.grammar, lbl)
        yield from _spec(s.spec, lbl)


def _spec(sp: SpecStats, lbl: list[str]) -> Iterable[Metric]:
    yield _counter("vllm:spec_decode_num_drafts", "Speculative rows verified (one request's "
                   "proposals checked in one step).", sp.num_drafts, lbl)
    yield _counter("vllm:spec_decode_num_draft_tokens", "Tokens proposed.", sp.num_draft_tokens,
                   lbl)
    yield _counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                   sp.num_accepted_tokens, lbl)
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Rows whose proposal at this position was accepted.",
                                  labels=["model_name", "position"])
    for i, n in enumerate(sp.accepted_per_pos):
        per_pos.add_metric([*lbl, str(i)], n)
    yield per_pos


def _grammar(g: GrammarStats, lbl: list[str]) -> Iterable[Metric]:
    yield _counter("tierserve:structured_requests", "Requests with a structured output (schema, "
                   "regex, choice, grammar or forced tool calls).", g.requests, lbl)
    yield _histogram("tierserve:grammar_compile_seconds", "Grammar compile time (each "
                     "distinct grammar once; in a compiler process, off the step).",
                     HistogramSnapshot(COMPILE_BUCKETS, g.compile_counts, g.compile_seconds), lbl)
    yield _counter("tierserve:grammar_cache_hits", "Grammar requests served by the compile "
                   "cache.", g.cache_hits, lbl)
    yield _counter("tierserve:grammar_compile_errors", "Grammars the compiler refused (400s).",
                   g.compile_errors, lbl)
    yield _counter("tierserve:grammar_mask_seconds", "Step time spent filling and applying "
                   "token bitmasks.", g.mask_seconds, lbl)
    yield _counter("tierserve:grammar_masked_rows", "Sampled rows a grammar masked.",
                   g.masked_rows, lbl)
    yield _gauge("tierserve:grammar_cache_bytes", "Bytes of compiled grammars the compile cache "
                 "holds (bounded by grammar_cache_bytes).", g.cache_bytes, lbl)
    yield _gauge("tierserve:grammar_cache_entries", "Grammars (and refusals) the compile cache "
                 "holds.", g.cache_entries, lbl)
    yield _counter("tierserve:grammar_cache_evictions", "Grammars the compile cache let go to "
                   "stay under its bound.", g.cache_evictions, lbl)
    yield _gauge("tierserve:grammar_compiles_running", "Grammar compiles running in the "
                 "compiler processes.", g.compiles_running, lbl)
    yield _gauge("tierserve:grammar_compiles_queued", "Grammar compiles waiting for a compiler "
                 "process.", g.compiles_queued, lbl)
    yield _counter("tierserve:grammar_compiles_cancelled", "Grammar compiles stopped because no "
                   "request waited for them any more (timed out or gone).",
                   g.compiles_cancelled, lbl)
    yield _counter("tierserve:grammar_compiles_rejected", "Grammar compiles refused by "
                   "grammar_compiles_per_key (429s).", g.compiles_rejected, lbl)


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric(labels, value)
    return g


def _histogram(name: str, doc: str, hist: HistogramSnapshot,
               labels: list[str]) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative = list(itertools.accumulate(hist.counts)) or [0]
    buckets = [(str(b), c) for b, c in zip(hist.bounds, cumulative)] + [("+Inf", cumulative[-1])]
    h.add_metric(labels, buckets, hist.total)
    return h


def _counter(name: str, doc: str, value: float, labels: list[str]) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["model_name"])
    c.add_metric(labels, value)
    return c


class _TierCollector:
    """Per-tier metrics, labelled by tier, from the tier manager's thread-safe stats."""

    COUNTERS = (("lookups", "Lookups that asked the tier."),
                ("hit_blocks", "Blocks a lookup found in the tier."),
                ("hit_tokens", "Tokens of those blocks."),
                ("loaded_blocks", "Blocks read from the tier and verified."),
                ("bytes_loaded", "Payload bytes read from the tier."),
                ("stored_blocks", "Blocks written to the tier."),
                ("bytes_stored", "Payload bytes written to the tier."),
                ("evictions", "Blocks the tier removed to make room."),
                ("dropped_writes", "Writes dropped because the tier's queue was full."))

    def __init__(self, stats: Callable[[], dict], model: str):
        self.stats, self.model = stats, model

    def collect(self) -> Iterable[Metric]:
        stats = self.stats()
        if not stats:
            return
        labels = ["model_name", "tier"]
        for field, doc in self.COUNTERS:
            c = CounterMetricFamily(f"tierserve:kv_tier_{field}", doc, labels=labels)
            for name, s in stats.items():
                c.add_metric([self.model, name], getattr(s, field))
            yield c
        yield from self._gauges(stats, labels)
        yield from self._errors_and_breaker(stats)
        for op in ("load", "store"):
            h = HistogramMetricFamily(f"tierserve:kv_tier_{op}_latency_seconds",
                                      f"Per-block {op} latency.", labels=labels)
            for name, s in stats.items():
                counts = getattr(s, f"{op}_latency")
                cumulative = list(itertools.accumulate(counts))
                buckets = [(str(b), c) for b, c in zip(LATENCY_BUCKETS, cumulative)]
                h.add_metric([self.model, name], buckets + [("+Inf", cumulative[-1])],
                             getattr(s, f"{op}_seconds"))
            yield h

    def _gauges(self, stats: dict, labels: list[str]) -> Iterable[Metric]:
        for field, doc in (("used_bytes", "Payload bytes the tier holds."),
                           ("capacity_bytes", "The tier's byte budget."),
                           ("queued_writes", "Writes waiting in the tier's queue.")):
            g = GaugeMetricFamily(f"tierserve:kv_tier_{field}", doc, labels=labels)
            for name, s in stats.items():
                value = getattr(s, field)
                if value is not None:
                    g.add_metric([self.model, name], value)
            yield g

    def _errors_and_breaker(self, stats: dict) -> Iterable[Metric]:
        e = CounterMetricFamily("tierserve:kv_tier_errors", "Tier failures by kind.",
                                labels=["model_name", "tier", "kind"])
        b = GaugeMetricFamily("tierserve:kv_tier_breaker_state", "1 for the breaker's state.",
                              labels=["model_name", "tier", "state"])
        for name, s in stats.items():
            for kind, n in s.errors.items():
                e.add_metric([self.model, name, kind], n)
            if s.breaker_state is not None:
                for state in ("closed", "open", "half_open"):
                    b.add_metric([self.model, name, state], float(s.breaker_state == state))
        yield e
        yield b


class _PolicyCollector:
    """The tier policy's per-request decisions, by outcome."""

    def __init__(self, counters, model: str):
        self.counters, self.model = counters, model

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily("tierserve:kv_policy_decisions",
                                "Tier policy decisions: loads chosen, tiers skipped by budget, "
                                "cost or a short prompt, loads abandoned at the deadline.",
                                labels=["model_name", "outcome"])
        counts = dataclasses.asdict(self.counters)
        promoted = counts.pop("promoted")
        for outcome, n in counts.items():
            c.add_metric([self.model, outcome], n)
        yield c
        yield _counter("tierserve:kv_promoted_blocks", "KV blocks loaded from a tier and written "
                       "to a faster one the request may store to (s3 -> disk).", promoted,
                       [self.model])


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model: str,
                 info: EngineInfo | None = None):
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot, model))
        if info is not None and info.tier_stats is not None:
            self.registry.register(_TierCollector(info.tier_stats, model))
            self.registry.register(_PolicyCollector(info.policy_counters, model))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, **kw).labels(model)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, **kw).labels(model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=_E2E_BUCKETS, **kw).labels(model)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to the first step that runs the request.",
                                    buckets=_E2E_BUCKETS, **kw).labels(model)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "Time from the first step to the first token.",
                                      buckets=_E2E_BUCKETS, **kw).labels(model)
        self.decode_time = Histogram("vllm:request_decode_time_seconds",
                                     "Time from the first token to the last.",
                                     buckets=_E2E_BUCKETS, **kw).labels(model)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                       buckets=_TOKEN_BUCKETS, **kw).labels(model)
        self.generation_tokens = Histogram("vllm:request_generation_tokens",
                                           "Generated tokens per request.",
                                           buckets=_TOKEN_BUCKETS, **kw).labels(model)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.http_errors = Counter("tierserve:http_errors", "Error responses by status code.",
                                   labelnames=["model_name", "status"], registry=self.registry)

    def observer(self) -> "RequestObserver":
        return RequestObserver(self)


class RequestObserver:
    """Feeds one group's outputs (child index, RequestOutput) into the latency histograms."""

    def __init__(self, m: ServerMetrics):
        self.m = m
        self.last: dict[int, float] = {}

    def on_output(self, i: int, out: RequestOutput) -> None:
        t = out.metrics.get("last_token")
        arrival = out.metrics.get("arrival")
        if t is not None and arrival is not None:
            prev = self.last.get(i)
            if prev is None:
                self.m.ttft.observe(t - arrival)
            elif t > prev:
                self.m.itl.observe(t - prev)
            self.last[i] = t
        if out.finished:
            if arrival is not None:
                self.m.e2e.observe(time.monotonic() - arrival)
            self._phases(out)
            reason = out.outputs[0].finish_reason if out.outputs else "abort"
            self.m.success.labels(self.m.model, reason or "abort").inc()

    def _phases(self, out: RequestOutput) -> None:
        """Queue, prefill and decode times and token counts of a finished request."""
        if not out.prompt_token_ids:  # aborted before the engine took it
            return
        t = out.metrics
        arrival, sched, first, last = (t.get(k) for k in ("arrival", "scheduled", "first_token",
                                                          "last_token"))
        if arrival is not None and sched is not None:
            self.m.queue_time.observe(max(0.0, sched - arrival))
        if sched is not None and first is not None:
            self.m.prefill_time.observe(max(0.0, first - sched))
        if first is not None and last is not None:
            self.m.decode_time.observe(max(0.0, last - first))
        self.m.prompt_tokens.observe(len(out.prompt_token_ids))
        if out.outputs:
            self.m.generation_tokens.observe(len(out.outputs[0].token_ids))
