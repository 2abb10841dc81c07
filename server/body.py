"""The edge check of every request: the JSON body, the path and the query are parsed once here
and every string in them is valid Unicode, or the request is a 400 that names the field.

Why here: JSON allows `"\\ud800"`, a lone UTF-16 surrogate, which Python turns into a str that
cannot be encoded; passed on, it fails deep inside (the tokenizer, the block hash, the JSON
encoder of an error message) as a 500. Checked once at the edge, nothing behind it needs to care.

The parse also names what Python's json module would only fail on: bytes that are not UTF-8,
nesting deeper than MAX_DEPTH, integers longer than MAX_INT_DIGITS, NaN and Infinity (not JSON).
A body that parses as JSON is JSON whatever its Content-Type says (see _as_json).
Every route module builds its router with `route_class=CheckedRoute`."""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

MAX_DEPTH = 64
"""Deepest nesting of objects and arrays a body may have (a JSON schema needs far less)."""
MAX_INT_DIGITS = 100
"""Longest integer literal (the largest integer any field takes has 20 digits)."""


class BodyError(HTTPException):
    """A 400 raised while FastAPI reads the body (it re-raises HTTPExceptions as they are); the
    app's handler turns it into an OpenAI error naming `param`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(400, message)
        self.message, self.param, self.code = message, param, code


class CheckedRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None

        async def checked(request: Request):
            _check_url(request)
            checked_request = _CheckedRequest(request.scope, request.receive)
            if takes_body:
                checked_request = await _as_json(checked_request)
            return await handler(checked_request)

        return checked


class _CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body())
        return self._json


async def _as_json(request: _CheckedRequest) -> _CheckedRequest:
    """A body sent without `Content-Type: application/json` (curl's -d sends a form type; some
    clients send none) is read as JSON all the same, as vLLM does: the request goes on as if the
    header had said JSON. A body that is not JSON either is a 400 that names the header."""
    content_type = request.headers.get("content-type")
    if _is_json(content_type):
        return request
    try:
        raw = await request.body()
    except ClientDisconnect:  # as FastAPI's own read answers it (to no one)
        raise BodyError("the client went away before its body arrived") from None
    if not raw:
        return request
    try:
        await request.json()
    except BodyError as e:
        sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise BodyError(f"Content-Type: send the body as JSON with Content-Type: "
                        f"application/json (this request had {sent}, and its body is not "
                        f"JSON: {e.message})", "Content-Type", "invalid_content_type") from None
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-type"]
    as_json = _CheckedRequest(dict(request.scope, headers=[*headers, _JSON_TYPE]),
                              request.receive)
    as_json._body, as_json._json = raw, request._json
    return as_json


_JSON_TYPE = (b"content-type", b"application/json")


def _is_json(content_type: str | None) -> bool:
    """application/json, or any application/*+json, as FastAPI reads them."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


def parse_body(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not valid UTF-8 (byte {e.start})",
                        code="invalid_json") from None
    try:
        value = json.loads(text, parse_int=_int, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise BodyError(f"malformed JSON body at line {e.lineno} column {e.colno} (char {e.pos}): "
                        f"{e.msg}", code="invalid_json") from None
    except RecursionError:
        raise BodyError(f"request body nests deeper than {MAX_DEPTH} levels (at char "
                        f"{_too_deep_at(text)})", code="invalid_json") from None
    except _Refused as e:
        at = text.find(e.literal)
        raise BodyError(f"{e.reason} at char {at}", code="invalid_json") from None
    check_text(value)
    return value


class _Refused(ValueError):
    def __init__(self, literal: str, reason: str):
        super().__init__(reason)
        self.literal, self.reason = literal, reason


def _int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(literal, f"request body: an integer of {len(literal.lstrip('-'))} digits "
                                f"(at most {MAX_INT_DIGITS})")
    return int(literal)


def _constant(literal: str) -> float:
    raise _Refused(literal, f"request body: {literal} is not a JSON number")


def check_text(value: Any) -> None:
    """Every string (keys included) encodes as UTF-8, and nesting stays within MAX_DEPTH; else a
    BodyError naming the field as a path (`messages[0].content`). Iterative: no recursion limit
    to meet on a deep body."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, v, depth = stack.pop()
        if isinstance(v, str):
            _check_str(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                shown = path if len(path) < 60 else f"{path[:40]}...{path[-12:]}"
                raise BodyError(f"{shown}: nests deeper than {MAX_DEPTH} levels", _field(path),
                                "invalid_json")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                if isinstance(k, str):
                    _check_str(k, f"{path}.<key>" if path else "<field name>")
                    sub = f"{path}.{k}" if path else k
                else:
                    sub = f"{path}[{k}]"
                stack.append((sub, item, depth + 1))


def _check_str(s: str, path: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BodyError(f"{path or 'body'}: not valid Unicode (a lone surrogate "
                        f"{s[e.start]!r} at character {e.start})", _field(path)) from None


def _field(path: str) -> str | None:
    """The top-level field a path starts with (OpenAI's `param` names a field)."""
    if not path or path.startswith("<"):
        return None
    return path.split(".")[0].split("[")[0]


def _check_url(request: Request) -> None:
    for name, value in request.path_params.items():
        if isinstance(value, str):
            _check_str(value, name)
    for name, value in request.query_params.multi_items():
        _check_str(name, "query")
        _check_str(value, name)


def _too_deep_at(text: str) -> int:
    """Where the nesting first passes MAX_DEPTH (the slow path of a refused body only)."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return i
        elif ch in "]}":
            depth -= 1
    return len(text)
