"""Structured-output fields -> one StructuredOutput, compiled before the request is queued.

The forms a client may send (at most one per request), and the field an error names:

    response_format {"type": "json_object"}                       response_format
    response_format {"type": "json_schema", "json_schema": {...}}  response_format.json_schema
    structured_outputs {"json" | "regex" | "choice" | "grammar"
                        | "structural_tag" | "json_object": ...}  structured_outputs.<key>
    guided_json, guided_regex, guided_choice, guided_grammar      that field

The compile runs in the engine's grammar pool (engine/worker/grammar_pool.py); the route awaits
it, so a schema xgrammar refuses is a 400 with the compiler's reason before any stream opens, and
the engine finds the grammar compiled in its cache. How a wait ends, and whose doing it was:

    compiled                                                   the request goes on
    xgrammar refused it, or it compiles past grammar_max_bytes 400 invalid_grammar (the schema)
    its own compile used grammar_compile_timeout_s of CPU      400 invalid_value (the schema)
    the key already had grammar_compiles_per_key large ones    429 grammar_compiles_per_key
    it waited the timeout queued behind its own key's compiles 429 grammar_queue_timeout
    it waited the timeout for workers busy with other keys'    503 grammar_workers_busy
    it ran STARVED_RUNS timeouts on the clock, short of CPU    503 grammar_cpu_busy

Queue wait and compile time are measured apart, each against the timeout, and the compile in
CPU seconds of its process, so neither the time a request waits for others nor the CPU the
engine takes from it counts against its own grammar. A request that gives up (a timeout; a
client that went away, where the route passes its Request) cancels its ticket; a compile no
request waits for is stopped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from tierserve.engine.api import (CompileProgress, CompileTicket, GrammarBusy, JobState, ParamError,
                                  StructuredOutput)
from tierserve.server.errors import ApiError, bad_request
from tierserve.server.protocol import _SamplingFields

STARVED_RUNS = 3
"""A compile that has run this many timeouts on the wall clock without using one timeout of CPU
is stopped: the server is too busy to finish it in a time a client waits."""

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


async def compile_checked(engine, c: Constraint, timeout_s: float, scope: str | None,
                          request: Request | None = None) -> None:
    """Wait for the grammar's compile off the event loop (see the table above). `scope`: the
    caller's cache scope (compiled grammars are not shared across API keys; the grammar pool
    is fair across scopes). `request`: when given, a client that goes away stops the wait (and
    the compile, if nobody else waits for it) within half a second."""
    try:
        # in a thread: the first call may build the compiler (xgrammar's import takes seconds)
        ticket = await asyncio.to_thread(engine.compile_grammar, c.spec, scope)
    except GrammarBusy as e:
        raise _busy(c.param, e) from None
    try:
        await _wait(ticket, c.param, timeout_s, request)
    except GrammarBusy as e:  # it ran past the quick lane's budget with the key at its limit
        raise _busy(c.param, e) from None
    except ParamError as e:
        raise bad_request(f"{c.param} is not usable: {e}", c.param,
                          code="invalid_grammar") from None
    finally:
        if not ticket.done():
            ticket.cancel()


async def _wait(ticket: CompileTicket, param: str, timeout_s: float,
                request: Request | None) -> None:
    waiter = asyncio.wrap_future(ticket)
    while not waiter.done():
        p = ticket.progress()
        step = _left(p, timeout_s)
        if step <= 0:
            raise _timed_out(param, timeout_s, p)
        await asyncio.wait({waiter}, timeout=step if request is None else min(step, 0.5))
        if not waiter.done() and request is not None and await request.is_disconnected():
            raise ApiError(499, "client disconnected", code="client_closed")
    waiter.result()


def _left(p: CompileProgress | None, timeout_s: float) -> float:
    """Seconds until the wait must be looked at again (<= 0: it is over). CPU time grows no
    faster than the clock, so sleeping what is left of the CPU budget never overshoots it."""
    if p is None or p.state is JobState.DONE:
        return 0.05  # settled a moment ago: its ticket is about to be answered
    if p.state is JobState.QUEUED:
        return timeout_s - p.waited_s
    return min(timeout_s - p.ran_s, STARVED_RUNS * timeout_s - p.run_wall_s)


def _timed_out(param: str, timeout_s: float, p: CompileProgress) -> ApiError:
    limit = f"{timeout_s:g} s (grammar_compile_timeout_s)"
    if p.state is JobState.RUNNING and p.ran_s >= timeout_s:
        queued = f"; it had waited {p.waited_s:.1f} s in the queue before, which does not " \
                 "count" if p.waited_s >= 0.1 else ""
        return bad_request(f"{param}: its grammar compiled for {limit} of CPU time without "
                           f"finishing and was stopped{queued}; simplify it", param)
    if p.state is JobState.RUNNING:
        return ApiError(503, f"{param}: its grammar compiled for {p.run_wall_s:.0f} s but got "
                        f"only {p.ran_s:.1f} s of CPU, the server being busy; it was stopped "
                        "and was not at fault: retry later", type_="server_error", param=param,
                        code="grammar_cpu_busy", headers={"Retry-After": "1"})
    whose = "this API key's" if p.tenant is not None else "the server's"
    if p.own_ahead or p.held_by_own:
        return ApiError(429, f"{param}: waited {limit} in {whose} grammar queue, behind its "
                        "own large compiles, and did not start; send fewer large schemas at "
                        "once", type_="rate_limit_exceeded", param=param,
                        code="grammar_queue_timeout", headers={"Retry-After": "1"})
    return ApiError(503, f"{param}: waited {limit} for a grammar compile worker, all busy with "
                    f"other API keys' compiles ({p.others_running} running), and did not start; "
                    "its grammar was not at fault: retry later", type_="server_error",
                    param=param, code="grammar_workers_busy", headers={"Retry-After": "1"})


def _busy(param: str, e: GrammarBusy) -> ApiError:
    who = "this API key already has" if e.tenant is not None else \
        "callers without a per-key cache scope already have"
    return ApiError(429, f"{param}: {who} {e.limit} large grammar compiles queued or running, "
                    f"the limit (grammar_compiles_per_key = {e.limit}); wait for one to finish "
                    "or send a smaller schema", type_="rate_limit_exceeded", param=param,
                    code="grammar_compiles_per_key", headers={"Retry-After": "1"})
