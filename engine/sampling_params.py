"""Per-request sampling parameters, validated at construction (vLLM's names and meanings), and
the structured-output constraint among them.

StructuredOutput: what a structured-output request asks for, as one canonical value (plain
Python, no torch). A request may constrain its output to a JSON schema, any JSON object, a
regular expression, one of a list of strings, an EBNF grammar, or an xgrammar structural tag
(tool calls use one). The server and the offline API build a StructuredOutput from vLLM's and
OpenAI's fields; the worker compiles it (engine/worker/grammar.py) and caches the compiled grammar
by `key`, the canonical text (compact JSON: the same schema sent with other spacing shares one
compile; key order is kept, since it is the order the output's properties come in).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any


class ParamError(ValueError):
    """A sampling parameter out of range. `param` names the field, for an API error body."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class GrammarKind(enum.Enum):
    JSON = "json"
    """A JSON schema."""
    JSON_OBJECT = "json_object"
    """Any JSON object (OpenAI's response_format json_object)."""
    REGEX = "regex"
    CHOICE = "choice"
    """Exactly one of a list of strings."""
    GRAMMAR = "grammar"
    """An EBNF grammar (xgrammar's dialect of GBNF; the start rule is `root`)."""
    STRUCTURAL_TAG = "structural_tag"
    """xgrammar's structural tag (JSON): free text and tagged, schema-checked sections."""


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output. Build it with the class methods."""

    kind: GrammarKind
    text: str
    """The canonical source: compact JSON for schemas, choices and tags (key order kept); the
    text as given for regexes and grammars."""

    @property
    def key(self) -> tuple[str, str]:
        """The compile cache's key."""
        return self.kind.value, self.text

    @classmethod
    def json(cls, schema: Any, param: str = "json") -> StructuredOutput:
        schema = _loads(schema, param) if isinstance(schema, str) else schema
        if not isinstance(schema, (dict, bool)):
            raise ParamError(param, f"{param} must be a JSON schema (an object), got "
                             f"{type(schema).__name__}")
        return cls(GrammarKind.JSON, _canonical(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(GrammarKind.JSON_OBJECT, "")

    @classmethod
    def regex(cls, pattern: Any, param: str = "regex") -> StructuredOutput:
        if not isinstance(pattern, str) or not pattern:
            raise ParamError(param, f"{param} must be a non-empty string")
        return cls(GrammarKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: Any, param: str = "choice") -> StructuredOutput:
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise ParamError(param, f"{param} must be a non-empty list of non-empty strings")
        return cls(GrammarKind.CHOICE, json.dumps(choices, ensure_ascii=False))

    @classmethod
    def grammar(cls, ebnf: Any, param: str = "grammar") -> StructuredOutput:
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise ParamError(param, f"{param} must be a non-empty EBNF grammar string")
        return cls(GrammarKind.GRAMMAR, ebnf)

    @classmethod
    def structural_tag(cls, tag: Any, param: str = "structural_tag") -> StructuredOutput:
        tag = _loads(tag, param) if isinstance(tag, str) else tag
        if not isinstance(tag, dict):
            raise ParamError(param, f"{param} must be a structural tag (a JSON object)")
        return cls(GrammarKind.STRUCTURAL_TAG, _canonical(tag))

    def ebnf_choice(self) -> str:
        """A CHOICE as an EBNF grammar: root ::= "a" | "b" (JSON string escapes are EBNF's)."""
        return "root ::= " + " | ".join(json.dumps(c) for c in json.loads(self.text))


def _loads(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ParamError(param, f"{param} is not valid JSON: {e}") from None


def _canonical(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) keeps every token."""
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    """None: up to the model's context."""
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Top-N alternatives per sampled token (0: only the sampled token's logprob)."""
    prompt_logprobs: int | None = None
    """Top-N alternatives per prompt token."""
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutput | None = None
    """Constrain the output to a schema, regex, choice or grammar (vLLM's name)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be at least 0"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "must be in [0, 20]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ParamError(name, f"{name} {why}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed "
                             f"max_tokens ({self.max_tokens})")
        for b in (self.logit_bias or {}).values():
            if not -100.0 <= b <= 100.0:
                raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {b}")
        if self.structured_outputs is not None and self.min_tokens:
            raise ParamError("min_tokens", "min_tokens cannot be combined with structured outputs: "
                             "the grammar decides where the output ends")
        if any(not s for s in self.stop):
            raise ParamError("stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def check_salt(salt: str | None) -> None:
    """A salt is a non-empty string of valid Unicode (vLLM refuses an empty one too): "" would
    read as "no salt" in one place and as a salt in another."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ParamError("cache_salt", "cache_salt must be a non-empty string when given")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise ParamError("cache_salt", "cache_salt must be valid Unicode (it holds a lone "
                         "surrogate)") from None
