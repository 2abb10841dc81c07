"""Structured outputs with xgrammar: compiled grammars, per-request matchers, the step's mask.

    who                     what                                      thread
    GrammarCompiler.submit  a ticket for the compile of a             any (server, engine)
                            StructuredOutput (cached by bytes)
    GrammarPool             the compile, fair across tenants: in a    its worker threads and
                            process that can be killed, then here     processes (grammar_pool.py)
    GrammarBook.add         a request waits until its compile is done  engine loop
    GrammarBook.mask        the bitmask of the step's constrained rows engine loop (in the step)
    GrammarBook.accept      advance a matcher by the sampled token    engine loop

A request whose grammar is still compiling waits in the scheduler's queue (`ready` is False):
other requests run meanwhile, and the step never compiles. A compile stops when no ticket waits
for it any more (each caller cancels its ticket when it gives up). The mask is applied to the
logits where they live (xgrammar's kernel: CPU or CUDA) before the sampler takes logprobs, so
reported logprobs are those of the constrained distribution, and constrained and free rows share
a batch. A matcher that accepts a stop token is terminated: the grammar allowed EOS only once
complete.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from tierserve.engine.sampling_params import GrammarKind, ParamError, StructuredOutput
from tierserve.engine.tokenizer import TextTokenizer
from tierserve.engine.worker.grammar_cache import Entry, GrammarCache
from tierserve.engine.worker.grammar_child import compile_grammar, malloc_trim
from tierserve.engine.worker.grammar_pool import (Busy, CompileProgress, Compiled, GrammarBusy,
                                                  GrammarPool, Job, Outcome, Refused)

log = logging.getLogger(__name__)

GRAMMAR_CACHE_BYTES = 256 << 20
"""Default bound of the compiled-grammar cache (EngineConfig.grammar_cache_bytes)."""
GRAMMAR_MAX_BYTES = 64 << 20
"""Default largest compiled grammar (EngineConfig.grammar_max_bytes)."""
GRAMMAR_COMPILES_PER_KEY = 4
"""Default large compiles one key may have queued or running (grammar_compiles_per_key)."""

_ADDEND = np.array([-np.inf, 0.0], dtype=np.float32)
"""Bit 0 (masked) -> -inf, bit 1 (allowed) -> 0."""
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_TRIM_BYTES = 1 << 20
"""Evictions of at least this many bytes hand the freed heap back to the OS (malloc_trim)."""

class GrammarError(ParamError):
    """A schema, regex or grammar xgrammar refuses; the message is the compiler's reason."""


COMPILE_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 30.0)


@dataclass(frozen=True)
class GrammarStats:
    """Structured outputs since start-up, at one moment (exported as metrics)."""

    requests: int = 0
    """Requests admitted with a structured output."""
    compile_counts: tuple[int, ...] = (0,) * (len(COMPILE_BUCKETS) + 1)
    """Compiles per COMPILE_BUCKETS bucket of seconds (the last: above every bound)."""
    compile_seconds: float = 0.0
    cache_hits: int = 0
    """Compiles a request did not wait for: the grammar was in the cache (or compiling)."""
    compile_errors: int = 0
    mask_seconds: float = 0.0
    """Time the steps spent filling and applying token bitmasks."""
    masked_rows: int = 0
    cache_bytes: int = 0
    """Bytes the compile cache holds now (bounded by grammar_cache_bytes)."""
    cache_entries: int = 0
    cache_evictions: int = 0
    """Grammars the cache let go to stay under its bound."""
    compiles_running: int = 0
    compiles_queued: int = 0
    compiles_cancelled: int = 0
    """Compiles stopped (dequeued, or their process killed) because no request waited for them:
    their requests timed out or went away."""
    compiles_rejected: int = 0
    """Compiles refused because their key had grammar_compiles_per_key in flight (429s)."""


class CompileTicket(cf.Future):
    """One caller's wait for a compile: a Future of the compiled grammar (GrammarError inside
    when it is refused, GrammarBusy when its key was at its limit). Cancel it to stop waiting:
    the compile stops once no ticket waits for it."""

    def __init__(self, key: Hashable, job: Job | None, pool: GrammarPool):
        super().__init__()
        self.key, self.job, self._pool = key, job, pool

    def progress(self) -> CompileProgress | None:
        """Where the compile is now (None once it is done, or for a cache hit)."""
        return None if self.job is None or self.done() else self._pool.progress(self.job)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer in a GrammarPool; caches the results by
    canonical text and caller's scope, bounded by bytes (GrammarCache).

    Thread-safe: the server submits (to answer a bad schema with a 400 before the request is
    queued) and the engine submits (the offline API); both wait on the same compile."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: tuple[int, ...],
                 workers: int = 2, cache_bytes: int = GRAMMAR_CACHE_BYTES,
                 max_bytes: int = GRAMMAR_MAX_BYTES, per_key: int = GRAMMAR_COMPILES_PER_KEY):
        import xgrammar as xgr  # imports transformers: only engines that get a grammar pay it

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._info = _tokenizer_info(xgr, tokenizer, vocab_size, stop_ids)
        self._cache = GrammarCache(cache_bytes)
        self._lock = threading.Lock()
        self._counts = dict(cache_hits=0, compile_errors=0, compile_seconds=0.0)
        self._compile_counts = [0] * (len(COMPILE_BUCKETS) + 1)
        # a grammar larger than the cache could not be kept for the engine's own lookup after
        # the server's: at most the cache's bytes
        self._here = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        """Compiles in this process what a compiler process proved (grammar_pool)."""
        self.pool = GrammarPool(self._info.serialize_json().encode(), self._compile_here,
                                self._settle, workers=workers, per_tenant=per_key,
                                max_bytes=min(max_bytes, cache_bytes))

    def stats(self, **more) -> GrammarStats:
        """The compile counters now, with the engine's own (`more`)."""
        running, queued = self.pool.load()
        with self._lock:
            return GrammarStats(
                compile_counts=tuple(self._compile_counts), **self._counts, **more,
                cache_bytes=self._cache.bytes, cache_entries=len(self._cache),
                cache_evictions=self._cache.evictions, compiles_running=running,
                compiles_queued=queued, compiles_cancelled=self.pool.cancelled,
                compiles_rejected=self.pool.rejected)

    def submit(self, spec: StructuredOutput, scope: str | None = None, count: bool = True,
               limited: bool = True) -> CompileTicket:
        """A ticket for the compiled grammar (done at once on a cache hit). `scope`: the caller's
        cache scope (per API key): a tenant never finds another's grammar compiled, so no
        compile time tells it what another sent (docs/security.md); it is also the tenant the
        pool is fair across. `count`: a hit counts as one (the engine's own lookup after the
        server's does not). `limited`: GrammarBusy when the scope has grammar_compiles_per_key
        large compiles in flight (the engine's own lookups are not limited)."""
        key = (scope, *spec.key)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._counts["cache_hits"] += count
                if entry.job is None:
                    return self._settled(key, entry)
            else:
                kind, text = _child_form(spec)
                job = self.pool.submit(key, scope, kind, text, limited)
                entry = self._cache.add(key, job, len(spec.text))
            ticket = CompileTicket(key, entry.job, self.pool)
            entry.tickets.add(ticket)
        ticket.add_done_callback(self._ticket_done)
        return ticket

    def _settled(self, key: Hashable, entry: Entry) -> CompileTicket:
        ticket = CompileTicket(key, None, self.pool)
        if entry.failed:
            ticket.set_exception(entry.value)
        else:
            ticket.set_result(entry.value)
        return ticket

    def _ticket_done(self, ticket: CompileTicket) -> None:
        """A cancelled ticket: the last one waiting for a compile stops it."""
        if not ticket.cancelled():
            return
        with self._lock:
            entry = self._cache.get(ticket.key)
            if entry is None or ticket not in entry.tickets:
                return
            entry.tickets.discard(ticket)
            job = entry.job
            if entry.tickets or job is None:
                return
            self._cache.drop(ticket.key)
        self.pool.cancel(job)

    def _compile_here(self, kind: str, text: str):
        return compile_grammar(self._here, kind, text)

    def _settle(self, job: Job, outcome: Outcome) -> None:
        """The pool's word on `job`: keep it (or forget it), then answer its tickets."""
        kind = job.key[1]
        if isinstance(outcome, Compiled):
            value, failed, size = outcome.grammar, False, outcome.bytes
        elif isinstance(outcome, Busy):
            value, failed, size = GrammarBusy(outcome.limit, job.tenant), True, 0
        else:
            value, failed, size = GrammarError(kind, _reason(outcome.reason)), True, 0
        keep = isinstance(outcome, Compiled) or isinstance(outcome, Refused) and outcome.cacheable
        freed = 0
        with self._lock:
            entry = self._cache.get(job.key)
            if entry is None or entry.job is not job:
                return  # every ticket was cancelled meanwhile
            tickets, entry.tickets = entry.tickets, set()
            if keep:
                freed = self._cache.settle(job.key, value, failed, size)
            else:
                self._cache.drop(job.key)
            self._count(outcome)
        for t in tickets:
            try:
                t.set_exception(value) if failed else t.set_result(value)
            except cf.InvalidStateError:  # cancelled just now
                pass
        if freed >= _TRIM_BYTES:
            malloc_trim()

    def _count(self, outcome: Outcome) -> None:
        if isinstance(outcome, Busy):
            return
        if not isinstance(outcome, Compiled):
            if not outcome.cacheable:
                return
            self._counts["compile_errors"] += 1
        self._counts["compile_seconds"] += outcome.seconds
        self._compile_counts[bisect.bisect_left(COMPILE_BUCKETS, outcome.seconds)] += 1

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        apply_bitmask(logits, bitmask, rows, self.vocab_size)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def close(self) -> None:
        self.pool.close()


def _child_form(spec: StructuredOutput) -> tuple[str, str]:
    """(kind, text) as grammar_child compiles them: a choice list as its EBNF grammar."""
    if spec.kind is GrammarKind.CHOICE:
        return GrammarKind.GRAMMAR.value, spec.ebnf_choice()
    return spec.kind.value, spec.text


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  vocab_size: int) -> None:
    """Masked tokens' logits to -inf in `rows` (bitmask row i masks logits row i). On a GPU
    xgrammar's kernel. On the CPU the bits unpacked by numpy into an addend of 0 (allowed) and
    -inf (masked), added in one pass: exact (x + 0 is x), ~60 us a row of a 49K vocabulary where
    xgrammar's CPU loop and torch's masked_fill took ~170-200 (bench/structured.py)."""
    v = vocab_size
    if logits.device.type != "cpu":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=v, indices=rows)
        return
    idx = torch.tensor(rows, dtype=torch.long)
    bits = np.unpackbits(bitmask[idx].numpy().view(np.uint8), axis=1, bitorder="little")
    addend = torch.from_numpy(np.take(_ADDEND, bits[:, :v]))
    if len(rows) == logits.shape[0]:
        logits[:, :v].add_(addend)
    else:
        logits[:, :v].index_add_(0, idx, addend)


def apply_masks(logits: torch.Tensor, request_ids: list[str], masks: dict[str, np.ndarray],
                vocab_size: int) -> None:
    """GrammarBook.fill's rows applied to the rows of `logits` whose request has one (a tensor-
    parallel rank: the main process's matchers filled them)."""
    rows = [i for i, rid in enumerate(request_ids) if rid in masks]
    if not rows:
        return
    bitmask = torch.full((len(request_ids), len(next(iter(masks.values())))), -1,
                         dtype=torch.int32)
    for i in rows:
        bitmask[i] = torch.from_numpy(masks[request_ids[i]])
    apply_bitmask(logits, bitmask, rows, vocab_size)


class GrammarBook:
    """The engine's constrained requests: each one's compile future, then its matcher."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._pending: dict[str, CompileTicket] = {}
        self._matchers: dict[str, object] = {}
        self._bitmask = compiler.bitmask(1)
        self._requests, self._mask_seconds, self._masked_rows = 0, 0.0, 0

    def stats(self) -> GrammarStats:
        return self.compiler.stats(requests=self._requests, mask_seconds=self._mask_seconds,
                                   masked_rows=self._masked_rows)

    def add(self, request_id: str, spec: StructuredOutput, scope: str | None = None) -> None:
        self._pending[request_id] = self.compiler.submit(spec, scope, count=False, limited=False)
        self._requests += 1

    def ready(self, request_id: str) -> bool:
        """False while the request's grammar compiles (it waits in the queue meanwhile)."""
        fut = self._pending.get(request_id)
        if fut is None:
            return True
        if not fut.done() or fut.exception() is not None:
            return False
        self._matchers[request_id] = self.compiler.matcher(fut.result())
        del self._pending[request_id]
        return True

    def wait(self, timeout: float) -> None:
        """Nothing else can run: sleep until a pending compile finishes (at most `timeout`)."""
        if self._pending:
            cf.wait(list(self._pending.values()), timeout, return_when=cf.FIRST_COMPLETED)

    def failed(self) -> list[tuple[str, BaseException]]:
        """Requests whose compile failed (the offline API may add without compiling first)."""
        bad = [(rid, f.exception()) for rid, f in self._pending.items()
               if f.done() and f.exception() is not None]
        for rid, _ in bad:
            del self._pending[rid]
        return bad

    @property
    def vocab_size(self) -> int:
        return self.compiler.vocab_size

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Mask, in place, the rows of `logits` whose request has a matcher."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return
        t0 = time.perf_counter()
        bitmask = self._filled(request_ids, rows)
        self.compiler.apply(logits, bitmask, rows)
        self._mask_seconds += time.perf_counter() - t0
        self._masked_rows += len(rows)

    __call__ = mask
    """The runner's `constrain` (model_runner.Constrain)."""

    def fill(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """The next token's bitmask row of each of these requests that has a matcher, without
        logits (tensor parallel: the ranks apply them to theirs, grammar.apply_masks)."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return {}
        t0 = time.perf_counter()
        bitmask = self._filled(request_ids, rows)
        self._mask_seconds += time.perf_counter() - t0
        self._masked_rows += len(rows)
        return {request_ids[i]: bitmask[i].numpy().copy() for i in rows}

    def _filled(self, request_ids: list[str], rows: list[int]) -> torch.Tensor:
        if self._bitmask.shape[0] < len(request_ids):
            self._bitmask = self.compiler.bitmask(max(len(request_ids), 2 * self._bitmask.shape[0]))
        bitmask = self._bitmask[:len(request_ids)]
        for i in rows:
            self._matchers[request_ids[i]].fill_next_token_bitmask(bitmask, i)
        return bitmask

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher; True when the grammar is terminated (it accepted a stop
        token) or refuses the token (a stop string or max_tokens would have to end it anyway)."""
        m = self._matchers.get(request_id)
        if m is None:
            return False
        if not m.accept_token(token):
            log.warning("request %s: the grammar refused token %d; ending it", request_id, token)
            return True
        return m.is_terminated()

    def remove(self, request_id: str) -> None:
        ticket = self._pending.pop(request_id, None)
        if ticket is not None:
            ticket.cancel()  # the compile stops if nobody else waits for it
        self._matchers.pop(request_id, None)


def _tokenizer_info(xgr, tokenizer: TextTokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """xgrammar's view of the vocabulary: every id's token string, padded to the logits' width."""
    backend = tokenizer.backend
    vocab = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(vocab, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(stop_ids),
                             add_prefix_space=meta["add_prefix_space"])


def _reason(e: BaseException) -> str:
    """xgrammar's message without its time stamp and source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _LOCATION.sub("", text)
