"""Incremental detokenization with stop strings found across token boundaries.

Text is decoded from a short window of recent tokens (prefix_offset..), so each step costs a few
tokens, and a delta is released only once it does not end in a partial UTF-8 character. Stop
strings are searched in the tail of the text; until a request finishes, the last
(longest stop string - 1) characters are held back, because they may begin a stop string.
"""

from __future__ import annotations

from tierserve.engine.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, stop: list[str], include_stop: bool,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, ids: list[int]) -> str | None:
        """Account for ids (the whole output so far). Returns the stop string hit, if any."""
        before = len(self.text)
        prefix_text = self.tok.decode(ids[self._prefix:self._read], self.skip_special)
        new_text = self.tok.decode(ids[self._prefix:], self.skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        self.text += new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(ids)
        return self._find_stop(before)

    def _find_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s

    def flush(self, ids: list[int]) -> None:
        """At the end: whatever is left, even a lone partial character."""
        rest = self.tok.decode(ids[self._prefix:], self.skip_special)
        done = self.tok.decode(ids[self._prefix:self._read], self.skip_special)
        self.text += rest[len(done):]
        self._prefix = self._read = len(ids)

    def visible(self, finished: bool) -> str:
        """Text safe to show: without a tail that may still become a stop string."""
        if finished or not self.hold:
            return self.text
        return self.text[:max(0, len(self.text) - self.hold)]
