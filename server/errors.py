"""Errors as values, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Routes raise ApiError; the handlers in app.py turn it (and validation failures, unknown routes,
oversized bodies and anything unexpected) into a JSON body. No stack trace reaches a client."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error a client can act on; `param` names the offending field when there is one."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def validation_message(errors: list[dict]) -> tuple[str, str | None, str]:
    """(message, param, code) for pydantic/FastAPI validation errors: name the field, what it
    takes and what came (`max_tokens: expected an integer, got a string ("5")`). `param` is the
    first error's field; of that field's errors the message tells the deepest, with every type a
    union would have taken there (`prompt[0]: expected a string, an integer or an array`); other
    fields with errors are listed after it."""
    if not errors:
        return "invalid request body", None, "invalid_value"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', '')}", None, "invalid_json"
    paths = [_path(e) for e in errors]
    if paths[0] is None:
        return _body_message(first)
    field = _top(paths[0])
    mine = [i for i, p in enumerate(paths) if p is not None and _top(p) == field]
    at = max(mine, key=lambda i: paths[i].count(".") + paths[i].count("["))
    path, err = paths[at], errors[at]
    others = sorted({_top(p) for p in paths if p is not None and _top(p) != field})
    also = f" (also: {', '.join(others)})" if others else ""
    param = paths[0]
    if err.get("type") == "missing":
        return f"{path}: field required{also}", param, "missing_required_parameter"
    expected = [_EXPECTED[e["type"]] for i, e in enumerate(errors)
                if paths[i] == path and e.get("type") in _EXPECTED]
    if expected:
        kinds = list(dict.fromkeys(expected))
        wanted = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"
        return f"{path}: expected {wanted}, got {_got(err.get('input'))}{also}", param, \
            "invalid_type"
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return f"{path}: {msg}{also}", param, "invalid_type"


_EXPECTED = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
             "bool_type": "a boolean", "string_type": "a string", "list_type": "an array",
             "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object"}
"""What a field takes, by pydantic's error type, in JSON's words."""


def _path(error: dict) -> str | None:
    """The error's field as a JSON path (`messages[0].content`), or None for the body itself.
    Union-branch names ('str', 'list[int]') are dropped so the path reads as the JSON field."""
    loc = [x for x in error.get("loc", ()) if x != "body"]
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc
                   if isinstance(x, int) or not _is_type_name(str(x))).lstrip(".") or None


def _top(path: str) -> str:
    return path.split(".")[0].split("[")[0]


def _got(value) -> str:
    """A JSON value as a message names it: its type, and a short form of a scalar."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), "a value")
    if isinstance(value, (list, dict)):
        return kind
    shown = json.dumps(value)
    return f"{kind} ({shown if len(shown) <= 40 else shown[:37] + '...'})"


def _body_message(error: dict) -> tuple[str, str | None, str]:
    """The body itself is wrong: empty (or null), or JSON that is not an object."""
    if error.get("type") == "missing" or error.get("input") is None:
        return ("the request body is empty (or null): send a JSON object, with Content-Type: "
                "application/json", None, "invalid_json")
    return (f"the request body must be a JSON object, got {_got(error.get('input'))}", None,
            "invalid_type")


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part or \
        part.startswith("function-") or part.startswith("literal[") or part.startswith("constrained")


def error_json(err: ApiError) -> str:
    """The error body as one JSON string (for an SSE error event mid-stream)."""
    return json.dumps(error_body(err.message, err.type, err.param, err.code))
