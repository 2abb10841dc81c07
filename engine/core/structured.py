"""What a structured-output request asks for, as one canonical value (plain Python, no torch).

A request may constrain its output to a JSON schema, any JSON object, a regular expression, one
of a list of strings, an EBNF grammar, or an xgrammar structural tag (tool calls use one). The
server and the offline API build a StructuredOutput from vLLM's and OpenAI's fields; the worker
compiles it (engine/worker/grammar.py) and caches the compiled grammar by `key`, the canonical
text (compact JSON: the same schema sent with other spacing shares one compile; key order is
kept, since it is the order the output's properties come in).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from tierserve.engine.sampling_params import ParamError

GRAMMAR_CACHE_BYTES = 256 << 20
"""Default bound of the compiled-grammar cache (EngineConfig.grammar_cache_bytes)."""
GRAMMAR_MAX_BYTES = 64 << 20
"""Default largest compiled grammar (EngineConfig.grammar_max_bytes)."""
GRAMMAR_COMPILES_PER_KEY = 4
"""Default large compiles one key may have queued or running (grammar_compiles_per_key)."""


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
