"""--speculative-config as vLLM spells it (JSON; YAML and LLM(speculative_config=...) too).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "PATH", "num_speculative_tokens": 4}

Plain Python, no torch: a bad value is a one-line ValueError at start-up."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """ngram (prompt lookup over the request's own tokens) or draft_model."""
    num_speculative_tokens: int
    """k: tokens proposed per step for one request, verified together in one target step."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix of the request's tokens to look up."""
    prompt_lookup_max: int = 5
    """ngram: the longest suffix looked up (longer matches are tried first)."""
    model: str | None = None
    """draft_model: the draft (an embedded alias, a .gguf file or a Hugging Face directory) with
    the target's vocabulary; its KV cache takes its share of the same memory budget."""
    acceptance_floor: float = 0.3
    """A request whose acceptance rate (a moving average of accepted / proposed) falls under this
    stops proposing for a while (2, 4, 8, ... up to 64 steps; then it tries again)."""
    compute_bound_batch: int | None = None
    """Rows (decodes plus proposals) a step may hold before it is compute-bound: proposals fill
    the batch up to it, the best-accepting requests first, and a batch of this many decodes
    proposes nothing. None: measured per device (8 on a CPU with AVX-512, 4 with AVX2: the rows
    the quantized kernels take from registers in one pass over the weights; 64 on CUDA, not yet
    measured); 0: no limit."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; methods: "
                             f"{', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, "
                             f"got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError("speculative_config: ngram needs 1 <= prompt_lookup_min <= "
                                 f"prompt_lookup_max, got {lo!r} and {hi!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs \"model\" (the draft's "
                             "path or alias)")
        if not 0 <= self.acceptance_floor <= 1:
            raise ValueError("speculative_config: acceptance_floor must be in [0, 1]")
        if self.compute_bound_batch is not None and self.compute_bound_batch < 0:
            raise ValueError("speculative_config: compute_bound_batch must be >= 0")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A config from JSON text or a dict; None, "" or "none" (no speculation) give None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if value.strip().lower() in ("", "none", "null"):
                return None
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; keys: "
                             f"{', '.join(sorted(fields))}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs \"method\" and \"num_speculative_tokens\"")
        return cls(**value)

    def describe(self) -> str:
        if self.method == "ngram":
            return (f"ngram k={self.num_speculative_tokens} lookup "
                    f"{self.prompt_lookup_min}..{self.prompt_lookup_max}")
        return f"draft_model {self.model} k={self.num_speculative_tokens}"


def as_dict(config: SpeculativeConfig | None) -> dict[str, Any] | None:
    return None if config is None else dataclasses.asdict(config)
