"""Prompt-lookup proposals: the request's own tokens predict its continuation.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are looked up earlier in
the request (prompt and output); at the latest earlier match, the tokens that followed it are the
proposal (up to k of them). Outputs that copy from their input (edits, extraction, code) match
often; others rarely, and a request without a match proposes nothing that step. Plain Python and
numpy, no model."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix of `tokens`; [] when no suffix of lookup_min tokens or more occurs earlier."""
        arr = np.asarray(tokens, dtype=np.int64)
        size = arr.shape[0]
        for n in range(min(self.lookup_max, size - 1), self.lookup_min - 1, -1):
            # windows that start before the suffix itself, so a continuation exists
            windows = sliding_window_view(arr[:size - 1], n)
            hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []
