"""Structured outputs with xgrammar: compiled grammars, per-request matchers, the step's mask.

    who                     what                                      thread
    GrammarCompiler.submit  compile a StructuredOutput once per key   a small pool (never the step)
                            (a future; cached, failures too)          callers: server, engine
    GrammarBook.add         a request waits until its compile is done  engine loop
    GrammarBook.mask        the bitmask of the step's constrained rows engine loop (in the step)
    GrammarBook.accept      advance a matcher by the sampled token    engine loop

A request whose grammar is still compiling waits in the scheduler's queue (`ready` is False):
other requests run meanwhile, and the step never compiles. The mask is applied to the logits
where they live (xgrammar's kernel: CPU or CUDA) before the sampler takes logprobs, so reported
logprobs are those of the constrained distribution, and constrained and free rows share a batch.
A matcher that accepts a stop token is terminated: the grammar allowed EOS only once complete.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from tierserve.engine.core.structured import GrammarKind, StructuredOutput
from tierserve.engine.sampling_params import ParamError
from tierserve.engine.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

_CACHE_ENTRIES = 512
_ADDEND = np.array([-np.inf, 0.0], dtype=np.float32)
"""Bit 0 (masked) -> -inf, bit 1 (allowed) -> 0."""
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


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


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer on a thread pool, cached by canonical text.

    Thread-safe: the server submits (to answer a bad schema with a 400 before the request is
    queued) and the engine submits (the offline API), and both get the same future."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: tuple[int, ...],
                 threads: int = 2):
        import xgrammar as xgr  # imports transformers: only engines that get a grammar pay it

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = _tokenizer_info(xgr, tokenizer, vocab_size, stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], cf.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._counts = dict(cache_hits=0, compile_errors=0, compile_seconds=0.0)
        self._compile_counts = [0] * (len(COMPILE_BUCKETS) + 1)

    def stats(self, **more) -> GrammarStats:
        """The compile counters now, with the engine's own (`more`)."""
        with self._lock:
            return GrammarStats(compile_counts=tuple(self._compile_counts), **self._counts, **more)

    def submit(self, spec: StructuredOutput, scope: str | None = None,
               count: bool = True) -> cf.Future:
        """The compiled grammar's future (done at once on a cache hit); GrammarError inside.
        `scope`: the caller's cache scope (per API key): a tenant never finds another's grammar
        compiled, so no compile time tells it what another sent (docs/security.md). `count`: a
        hit counts as one (the engine's own lookup after the server's does not)."""
        key = (scope, *spec.key)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self._counts["cache_hits"] += count
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return fut

    def _compile(self, spec: StructuredOutput):
        t0 = time.perf_counter()
        try:
            return self._build(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            with self._lock:
                self._counts["compile_errors"] += 1
            raise GrammarError(spec.kind.value, _reason(e)) from None
        finally:
            took = time.perf_counter() - t0
            with self._lock:
                self._counts["compile_seconds"] += took
                self._compile_counts[bisect.bisect_left(COMPILE_BUCKETS, took)] += 1

    def _build(self, spec: StructuredOutput):
        c = self._compiler
        if spec.kind is GrammarKind.JSON:
            # no free whitespace (one line, ", " and ": "): a small model at temperature 1 can
            # otherwise write whitespace until max_tokens (any_whitespace lets it)
            return c.compile_json_schema(spec.text, any_whitespace=False, strict_mode=True)
        if spec.kind is GrammarKind.JSON_OBJECT:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind is GrammarKind.REGEX:
            return c.compile_regex(spec.text)
        if spec.kind is GrammarKind.CHOICE:
            return c.compile_grammar(spec.ebnf_choice())
        if spec.kind is GrammarKind.GRAMMAR:
            return c.compile_grammar(spec.text)
        return c.compile_structural_tag(spec.text)

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        apply_bitmask(logits, bitmask, rows, self.vocab_size)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
        self._pending: dict[str, cf.Future] = {}
        self._matchers: dict[str, object] = {}
        self._bitmask = compiler.bitmask(1)
        self._requests, self._mask_seconds, self._masked_rows = 0, 0.0, 0

    def stats(self) -> GrammarStats:
        return self.compiler.stats(requests=self._requests, mask_seconds=self._mask_seconds,
                                   masked_rows=self._masked_rows)

    def add(self, request_id: str, spec: StructuredOutput, scope: str | None = None) -> None:
        self._pending[request_id] = self.compiler.submit(spec, scope, count=False)
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
        self._pending.pop(request_id, None)
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
