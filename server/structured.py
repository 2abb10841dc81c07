"""Structured-output fields -> one StructuredOutput, compiled before the request is queued.

The forms a client may send (at most one per request), and the field an error names:

    response_format {"type": "json_object"}                       response_format
    response_format {"type": "json_schema", "json_schema": {...}}  response_format.json_schema
    structured_outputs {"json" | "regex" | "choice" | "grammar"
                        | "structural_tag" | "json_object": ...}  structured_outputs.<key>
    guided_json, guided_regex, guided_choice, guided_grammar      that field

The compile runs on the engine's grammar threads; the route awaits it (bounded by
grammar_compile_timeout_s), so a schema xgrammar refuses is a 400 with the compiler's reason
before any stream opens, and the engine finds the grammar compiled in its cache.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tierserve.engine.core.structured import StructuredOutput
from tierserve.engine.sampling_params import ParamError
from tierserve.server.errors import bad_request
from tierserve.server.protocol import _SamplingFields

_FORMS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_RESPONSE_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class Constraint:
    spec: StructuredOutput
    param: str
    """The request field it came from (what a compile error names)."""


def requested(body: _SamplingFields) -> Constraint | None:
    """The body's structured-output request, checked for shape; None for free text."""
    found = [c for c in (_response_format(body.response_format),
                         _structured_outputs(body.structured_outputs), *_guided(body))
             if c is not None]
    if len(found) > 1:
        raise bad_request(f"{found[0].param} and {found[1].param} both constrain the output; "
                          "send at most one", found[1].param.split(".")[0])
    return found[0] if found else None


def _response_format(fmt: dict | None) -> Constraint | None:
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind not in _RESPONSE_TYPES:
        raise bad_request(f"response_format.type must be one of {list(_RESPONSE_TYPES)}, got "
                          f"{kind!r}", "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(StructuredOutput.json_object(), "response_format")
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("response_format.json_schema must be an object with a name and a "
                          "schema", "response_format.json_schema")
    schema = js.get("schema", js.get("json_schema"))
    if schema is None:
        raise bad_request("response_format.json_schema.schema is required",
                          "response_format.json_schema.schema")
    return _build(lambda p: StructuredOutput.json(schema, p), "response_format.json_schema.schema")


def _structured_outputs(so: dict | None) -> Constraint | None:
    if so is None:
        return None
    given = [k for k in _FORMS if so.get(k) not in (None, False)]
    unknown = sorted(set(so) - set(_FORMS) - {"disable_any_whitespace", "disable_fallback",
                                              "disable_additional_properties",
                                              "whitespace_pattern", "backend"})
    if unknown:
        raise bad_request(f"structured_outputs has unknown field {unknown[0]!r}; one of "
                          f"{list(_FORMS)} is expected", f"structured_outputs.{unknown[0]}")
    if len(given) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {list(_FORMS)}, got "
                          f"{given or 'none'}", "structured_outputs")
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json_object":
        return Constraint(StructuredOutput.json_object(), param)
    return _build(lambda p: getattr(StructuredOutput, key)(so[key], p), param)


def _guided(body: _SamplingFields) -> list[Constraint]:
    out = []
    for field, form in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            out.append(_build(lambda p: getattr(StructuredOutput, form)(value, p), field))
    return out


def _build(make, param: str) -> Constraint:
    try:
        return Constraint(make(param), param)
    except ParamError as e:
        raise bad_request(str(e), e.param) from None


async def compile_checked(engine, c: Constraint, timeout_s: float, scope: str | None) -> None:
    """Wait for the grammar's compile off the event loop; a refusal is a 400 naming the field.
    `scope`: the caller's cache scope (compiled grammars are not shared across API keys)."""
    # in a thread: the first call may build the compiler (xgrammar's import takes seconds)
    fut = await asyncio.to_thread(engine.compile_grammar, c.spec, scope)
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout_s)
    except asyncio.TimeoutError:
        raise bad_request(f"{c.param}: the grammar did not compile within {timeout_s:g} s "
                          "(grammar_compile_timeout_s); simplify it", c.param) from None
    except ParamError as e:
        raise bad_request(f"{c.param} is not usable: {e}", c.param,
                          code="invalid_grammar") from None
