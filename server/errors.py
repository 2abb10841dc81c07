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
    """(message, param, code) for pydantic/FastAPI validation errors: name the field."""
    if not errors:
        return "invalid request body", None, "invalid_value"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', '')}", None, "invalid_json"
    loc = [x for x in first.get("loc", ()) if x != "body"]
    # Drop union-branch names (e.g. 'str', 'list[int]') so the path reads as the JSON field;
    # list positions read as JSON paths do: tokens[1].
    path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc
                   if isinstance(x, int) or not _is_type_name(str(x))).lstrip(".") or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "missing":
        return f"{path}: field required", path, "missing_required_parameter"
    extra = f" ({len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{path}: {msg}" if path else msg) + extra, path, "invalid_type"


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part or \
        part.startswith("function-") or part.startswith("literal[") or part.startswith("constrained")


def error_json(err: ApiError) -> str:
    """The error body as one JSON string (for an SSE error event mid-stream)."""
    return json.dumps(error_body(err.message, err.type, err.param, err.code))
