"""The synchronous engine: requests in, one scheduled model step at a time, outputs out. Built
by engine/build.py; what a request carries beyond the scheduler's state (its grammar, its
speculation, its KV tiers) lives in extensions (engine/extensions.py), run over a list.

Not thread-safe: one thread owns it (the offline LLM, or the async engine's loop thread)."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass, field

from tierserve.engine.build import build_engine, engine_info
from tierserve.engine.config import EngineConfig
from tierserve.engine.core.block_hash import scope_key
from tierserve.engine.core.kv_hints import NO_HINTS, KVHints
from tierserve.engine.core.request import Request, RequestId, RequestStatus
from tierserve.engine.core.scheduler import Scheduler
from tierserve.engine.detokenizer import IncrementalDetokenizer
from tierserve.engine.extensions import GrammarExtension, RequestExtension, SpecExtension
from tierserve.engine.outputs import CompletionOutput, RequestOutput, TopLogprobs
from tierserve.engine.sampling_params import (ParamError, SamplingParams, StructuredOutput,
                                              check_salt)
from tierserve.engine.spec.speculator import SpecStats
from tierserve.engine.stats import EngineSnapshot, EngineStats, snapshot
from tierserve.engine.worker.grammar import GrammarBook, GrammarCompiler, GrammarStats

log = logging.getLogger(__name__)


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
        parts = build_engine(config)
        self.config, self.device_choice, self.dtype_choice = (parts.config, parts.device_choice,
                                                              parts.dtype_choice)
        self.num_threads, self.model_config = parts.num_threads, parts.model_config
        self.tokenizer, self.model_path = parts.tokenizer, parts.model_path
        self.executor, self.pool, self.fingerprint = parts.executor, parts.pool, parts.fingerprint
        self.max_model_len = parts.max_model_len
        self.connector = parts.kv
        """The KV connector's two sides, joined once a step: the scheduler side (self.kv,
        torch-free) and the worker side (self.kv_worker); no-ops without tiers."""
        self.kv, self.kv_worker = parts.kv.scheduler, parts.kv.worker
        self.speculator = parts.speculator
        """Speculative decoding's proposer and bookkeeping (None: off)."""
        self.grammar = GrammarExtension(self._grammar_compiler)
        self.extensions: list[RequestExtension] = [self.grammar, self.connector]
        if self.speculator is not None:
            self.extensions.append(SpecExtension(self.speculator))
        self.scheduler = Scheduler(config.scheduler, self.pool, self._hash_extra,
                                   self.kv.on_admit, self._ready)
        self.stats = EngineStats()
        self._tracked: dict[RequestId, _Tracked] = {}
        self.info = engine_info(parts)
        """What the server may know of this engine (read-only, published once)."""
        facts = self.executor.facts()
        log.info("engine ready: %s, %d layers, %d KV blocks of %d tokens (%.0f MiB), "
                 "max_model_len %d, backend %s, %d threads", self.config.model,
                 self.model_config.num_layers, parts.num_blocks, self.pool.block_size,
                 facts.kv_bytes / 2**20, self.max_model_len, facts.backend, self.num_threads)

    def close(self) -> None:
        """Stop the tier threads (queued writes finish first, for a few seconds at most), the
        tensor-parallel workers and the grammar compiler."""
        self.connector.close()
        self.executor.close()
        self.grammar.close()

    @property
    def grammars(self) -> GrammarBook:
        """The structured-output grammars, built on first use (xgrammar imports transformers,
        ~2 s): the server builds it at start-up, off the loop thread (compile_grammar)."""
        return self.grammar.book

    def compile_grammar(self, spec: StructuredOutput, scope: str | None = None) -> cf.Future:
        """Start (or find, within the caller's cache scope) the compile of `spec`; any thread.
        GrammarError inside the future."""
        return self.grammar.compile(spec, scope)

    def spec_stats(self) -> SpecStats:
        """A copy of speculative decoding's counters (zeros when it is off)."""
        return self.speculator.stats.copy() if self.speculator is not None else SpecStats()

    def grammar_stats(self) -> GrammarStats:
        return self.grammar.stats()

    def snapshot(self) -> EngineSnapshot:
        """What the loop thread publishes after each step (metrics, admission)."""
        return snapshot(self.stats, self.pool, self.scheduler, self.executor.sparse_stats(),
                        self.num_tracked, self.grammar_stats(), self.spec_stats())

    def _grammar_compiler(self) -> GrammarCompiler:
        c = self.config
        return GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                               tuple(self.model_config.eos_token_ids),
                               cache_bytes=c.grammar_cache_bytes, max_bytes=c.grammar_max_bytes,
                               per_key=c.grammar_compiles_per_key)

    def _ready(self, req: Request) -> bool:
        return all(ext.ready(req) for ext in self.extensions)

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
        for ext in self.extensions:
            ext.on_add(req)
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
        check_salt(cache_salt)

    def abort_request(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
            self._retire(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.connector.bring_in(self.scheduler)
        outputs = self._refused()
        for ext in self.extensions:
            ext.before_schedule(self.scheduler.running)
        out = self.scheduler.schedule()
        self.connector.before_forward(out)
        if out.empty:  # only loads or compiles are in flight: wait instead of spinning
            if not outputs:
                self.connector.wait(0.02)
                self.grammar.wait(0.02)
            return outputs
        started = time.monotonic()
        result = self.executor.execute(out, self.grammar.built)  # constrain(logits, ids)
        full = self.scheduler.update(out, result.sampled)
        now = time.monotonic()
        self.connector.after_forward(out.num_batched_tokens, now - started, full)
        self._count_step(out.num_batched_tokens, result)
        for s in out.scheduled:
            tr = self._tracked.get(s.request.request_id)
            if tr is None:
                continue
            tr.metrics.setdefault("scheduled", started)
            rid = tr.request.request_id
            if tr.prompt_logprobs is not None and rid in result.prompt_logprobs:
                tr.prompt_logprobs.extend(result.prompt_logprobs[rid])
            tokens = result.sampled.get(rid)
            if tokens is None:
                continue
            tr.metrics.setdefault("first_token", now)
            tr.metrics["last_token"] = now
            done = [ext.on_step_result(tr.request, tokens, len(s.spec_token_ids))
                    for ext in self.extensions]
            self._take_tokens(tr, tokens, result.logprobs.get(rid), any(done))
            outputs.append(self._output(tr))
        return outputs

    def _count_step(self, tokens: int, result) -> None:
        st = self.stats
        st.steps += 1
        st.computed_tokens += tokens
        st.iteration_tokens.observe(tokens)
        st.table_width.observe(result.table_width)
        st.metadata_bytes.observe(result.metadata_bytes)
        st.metadata_seconds += result.metadata_seconds

    def _take_tokens(self, tr: _Tracked, tokens: list[int], logprobs: list | None,
                     ended: bool) -> None:
        """The step's kept tokens (the update appended them), checked for a stop one at a time
        as if each came from its own step: a stop at one drops the tokens after it. `ended`: an
        extension ends the request with this step (a complete grammar: one token a step)."""
        out = tr.request.output_token_ids
        del out[len(out) - len(tokens):]
        for i, tok in enumerate(tokens):
            out.append(tok)
            if logprobs is not None and tr.logprobs is not None:
                tr.logprobs.append(logprobs[i])
            self.stats.generation_tokens += 1
            self._check_stop(tr, ended and i == len(tokens) - 1)
            if tr.request.status.finished:
                return

    def _refused(self) -> list[RequestOutput]:
        """Requests an extension cannot serve end here, aborted: a grammar that does not
        compile (the server compiles before it queues a request, so only an offline caller
        that did not can get here)."""
        outputs = []
        for ext in self.extensions:
            for rid, why in ext.failed():
                log.warning("request %s: its structured output does not compile: %s", rid, why)
                tr = self._tracked.get(rid)
                if tr is None:
                    self.abort_request(rid)
                    continue
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                outputs.append(self._output(tr))
        return outputs

    def _check_stop(self, tr: _Tracked, ended: bool) -> None:
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
        if status is None and ended:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if status is None and (n >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if hit is None:
                tr.detok.flush(req.output_token_ids)
            req.stop_reason = reason
            self.scheduler.finish_requests([req.request_id], status)
            self.stats.finished_requests += 1

    def _output(self, tr: _Tracked) -> RequestOutput:
        """The request's output so far; a finished one retires here."""
        req = tr.request
        done = req.status.finished
        comp = CompletionOutput(0, tr.detok.visible(done), list(req.output_token_ids),
                                list(tr.logprobs) if tr.logprobs is not None else None,
                                req.status.value if done else None, req.stop_reason)
        decision, hits = self.connector.facts(req)
        if done:
            self._retire(req)
        return RequestOutput(req.request_id, tr.prompt, req.prompt_token_ids, [comp], done,
                             tr.prompt_logprobs, req.num_cached_tokens, dict(tr.metrics),
                             decision, hits)

    def _retire(self, req: Request) -> None:
        """The one place a request ends (finished, stopped or aborted): its state forgotten
        here and in every extension."""
        self._tracked.pop(req.request_id, None)
        for ext in self.extensions:
            ext.on_finish(req)
