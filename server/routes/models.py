"""GET /v1/models, GET /v1/models/{model}, GET /version, GET /health, POST /tokenize,
POST /detokenize, GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tierserve import __version__
from tierserve.server.body import CheckedRoute
from tierserve.server.errors import ApiError, bad_request
from tierserve.server.protocol import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                             TokenizeRequest, TokenizeResponse, VersionResponse)
from tierserve.server.routes.chat import render_chat
from tierserve.server.serving import check_model, context

router = APIRouter(route_class=CheckedRoute)


def _card(request: Request, name: str) -> ModelCard:
    ctx = context(request)
    return ModelCard(id=name, created=ctx.created, root=ctx.config.model,
                     max_model_len=ctx.engine.max_model_len)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """A card per served name (one model behind them all)."""
    return ModelList(data=[_card(request, n) for n in context(request).config.model_names])


# The openai client's models.retrieve(); `path` keeps ids with a slash ("org/name") whole.
@router.get("/v1/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    check_model(context(request), model)
    return _card(request, model)


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


# Probes send HEAD as often as GET: both answer the same (HEAD without a body).
@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    engine = context(request).engine
    if engine.draining:
        raise ApiError(503, "the server is shutting down", type_="server_error",
                       code="shutting_down")
    if not engine.alive:
        raise ApiError(503, "the engine loop is not running", type_="server_error",
                       code="engine_dead")
    return Response(status_code=200)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    ctx = context(request)
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        ids = render_chat(ctx, body.messages, body.add_generation_prompt is not False,
                          body.chat_template_kwargs)
    else:
        ids = ctx.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens
                                          is not False)
    return TokenizeResponse(count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx = context(request)
    check_model(ctx, body.model)
    vocab = ctx.engine.tokenizer.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is out of range [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=ctx.engine.tokenizer.decode(body.tokens))


@router.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(context(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
