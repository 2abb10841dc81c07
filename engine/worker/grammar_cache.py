"""Compiled grammars by (cache scope, kind, text), bounded by bytes.

Eviction order: least recently used first (a lookup or a finished compile makes an entry the
most recent), among finished entries only; a compile in flight is never evicted (its tickets wait
for it, and the per-tenant limit bounds how many there are). An entry's bytes are the compiled
grammar's own (xgrammar's memory_size_bytes) plus its key's text; a refusal is cached too and
costs its text. An entry larger than the whole bound is not kept. Not thread-safe: the
GrammarCompiler's lock guards it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable

ENTRY_OVERHEAD = 256
"""Bytes counted per entry besides its grammar and text (the key, the entry, the dict slot)."""


@dataclass(eq=False)
class Entry:
    text_bytes: int
    job: object | None = None
    """The compile in flight (grammar_pool.Job); None once it settled."""
    value: object = None
    """The compiled grammar, or the exception every lookup raises (a refusal)."""
    failed: bool = False
    size: int = 0
    """Bytes counted for it (0 while compiling)."""
    tickets: set = field(default_factory=set)
    """Callers waiting for the compile in flight."""


class GrammarCache:
    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def add(self, key: Hashable, job: object, text_bytes: int) -> Entry:
        """A compile now in flight for `key`."""
        entry = self._entries[key] = Entry(text_bytes, job=job)
        return entry

    def drop(self, key: Hashable) -> None:
        """Forget a compile in flight (nobody waits for it, or it failed in a way not worth
        keeping)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size

    def settle(self, key: Hashable, value: object, failed: bool, grammar_bytes: int) -> int:
        """The compile of `key` is done: keep its result (if it fits) and evict down to the
        bound. Returns the bytes evicted."""
        entry = self._entries[key]
        entry.job, entry.value, entry.failed = None, value, failed
        entry.size = grammar_bytes + entry.text_bytes + ENTRY_OVERHEAD
        if entry.size > self.limit_bytes:  # it alone would flush everything: not kept
            del self._entries[key]
            self.evictions += 1
            return entry.size
        self._entries.move_to_end(key)
        self.bytes += entry.size
        return self._evict()

    def _evict(self) -> int:
        freed = 0
        for key in list(self._entries):
            if self.bytes <= self.limit_bytes:
                break
            entry = self._entries[key]
            if entry.job is None:
                del self._entries[key]
                self.bytes -= entry.size
                freed += entry.size
                self.evictions += 1
        return freed
