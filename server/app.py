"""The FastAPI app: routers, the request gate (request id, API key, body size) and error handlers."""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierserve.engine.api import AsyncEngine
from tierserve.server.auth import KeyRing
from tierserve.server.body import BodyError
from tierserve.server.config import ServerConfig, read_chat_template
from tierserve.server.errors import ApiError, error_response, validation_message
from tierserve.server.metrics import ServerMetrics
from tierserve.server.policy import default_hints
from tierserve.server.routes import backends, chat, completions, kv_events, models
from tierserve.server.serving import ServerContext

log = logging.getLogger(__name__)

_OPEN = ("/health", "/metrics")
"""The only paths served without an API key (unless auth_health_metrics): probes and scrapers.
Exact paths: anything else, /docs and unknown routes included, needs a key when keys are set."""


class RequestGate:
    """Pure ASGI middleware: X-Request-Id in and out, bearer-key check (the verified caller goes
    to the request's state, server/auth.py), request body limit."""

    def __init__(self, app, config: ServerConfig, keys: KeyRing, on_denied=None):
        self.app, self.config, self.keys = app, config, keys
        self.on_denied = on_denied
        """Called with the status of each answer the gate gives itself (401, 413): counted as
        the app's error handlers count theirs."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        if "authorization" in headers:
            state["caller"] = self.keys.identify(headers["authorization"])
        rid_header = (b"x-request-id", rid.encode("latin-1", "replace"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + [rid_header]
            await send(message)

        denied = self._deny(scope["path"], headers, state.get("caller"))
        if denied is None and "content-length" not in headers:  # chunked: count as it comes
            receive, denied = await self._read_body(receive)
        if denied is not None:
            if self.on_denied is not None:
                self.on_denied(denied.status_code)
            return await denied(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)

    async def _read_body(self, receive):
        """Read a body of unknown length here, up to max_body_bytes, and replay it to the app
        (the app's body parser would turn an error raised inside receive() into a 400). With a
        Content-Length, the HTTP server already holds the client to it, and _deny checked it."""
        limit, seen, messages = self.config.max_body_bytes, 0, []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away: the app will see it
                break
            seen += len(message.get("body", b""))
            if seen > limit:
                return receive, _too_large(limit)
            if not message.get("more_body", False):
                break
        queued = iter(messages)

        async def replay():
            return next(queued, None) or await receive()

        return replay, None

    def _deny(self, path: str, headers: dict[str, str], caller):
        if self.keys.required and (self.config.auth_health_metrics or path not in _OPEN):
            if caller is None:
                what = "missing" if not headers.get("authorization") else "incorrect"
                return error_response(ApiError(
                    401, f"API key {what}: send 'Authorization: Bearer <key>'.",
                    param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.config.max_body_bytes:
            return _too_large(self.config.max_body_bytes)
        return None


def _too_large(limit: int):
    return error_response(ApiError(413, f"request body exceeds the limit of {limit} bytes",
                                   code="request_too_large"))


def build_app(config: ServerConfig, engine: AsyncEngine) -> FastAPI:
    info = engine.info
    metrics = ServerMetrics(lambda: engine.snapshot, config.model_name, info)
    tiers = list(info.tiers)
    ctx = ServerContext(config, engine, metrics, int(time.time()), tiers,
                        default_hints(config, tiers))
    if config.chat_template is not None:
        engine.set_chat_template(read_chat_template(config.chat_template))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()

    app = FastAPI(title="tierserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM server (see docs/api.md).")
    app.state.ctx = ctx
    keys = app.state.keys = KeyRing(config.api_key, config.admin_api_key)
    for r in (completions.router, chat.router, models.router, backends.router, kv_events.router):
        app.include_router(r)
    _install_error_handlers(app, metrics, config.api_key + config.admin_api_key)
    app.add_middleware(RequestGate, config=config, keys=keys,
                       on_denied=lambda status: metrics.http_errors.labels(metrics.model,
                                                                           str(status)).inc())
    if config.allowed_origins:  # added last: outermost, so a preflight never meets the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id", "X-KV-Policy", "X-KV-Hit-Tokens"])
    _pin_model_name(app, config.model_names)
    return app


def _pin_model_name(app: FastAPI, names: tuple[str, ...]) -> None:
    """The schema's `model` fields list the served names (any other gets 404)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for comp in schema.get("components", {}).get("schemas", {}).values():
                model = comp.get("properties", {}).get("model")
                if model is not None and model.get("type") == "string":
                    model["enum"] = list(names)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics, keys: tuple[str, ...]) -> None:
    def count(status: int) -> None:
        metrics.http_errors.labels(metrics.model, str(status)).inc()

    def reply(err: ApiError):
        """Messages may quote what the client sent (a model name, a path): never an API key."""
        for key in keys:
            err.message = err.message.replace(key, "***")
        return error_response(err)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        count(exc.status)
        return reply(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        count(400)
        message, param, code = validation_message(_plain(exc.errors()))
        return reply(ApiError(400, message, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        count(exc.status_code)
        if isinstance(exc, BodyError):
            return reply(ApiError(400, exc.message, param=exc.param, code=exc.code))
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        return reply(ApiError(exc.status_code, f"{detail}: {request.method} "
                              f"{request.url.path}", type_=type_, headers=exc.headers,
                              code=_HTTP_CODES.get(exc.status_code, "http_error")))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        count(500)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, "internal server error", type_="server_error",
                                       code="internal_error"))


_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
"""The `code` of Starlette's own answers: an unknown route, a method the route lacks, a body
FastAPI could not read."""


def _plain(errors) -> list[dict]:
    """Validation errors with only JSON-safe values (inputs may hold bytes or exceptions)."""
    return json.loads(json.dumps(list(errors), default=str))
