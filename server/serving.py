"""What the completion and chat routes share: request -> SamplingParams, admission into the async
engine, collecting a group without streaming, and client-disconnect handling."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from tierserve.engine.api import (AsyncEngine, ChildRequest, EngineStopped, GroupStream, KVHints,
                                  ParamError, QueueFull, RequestOutput, SamplingParams,
                                  StructuredOutput, TierDecision, TierDescriptor)
from tierserve.server.auth import caller, tenant_of
from tierserve.server.config import ServerConfig
from tierserve.server.errors import ApiError, bad_request
from tierserve.server.metrics import RequestObserver, ServerMetrics
from tierserve.server.policy import applied_params, parse_hints, policy_header
from tierserve.server.protocol import ChatCompletionRequest, _SamplingFields

log = logging.getLogger(__name__)

_INT64 = (1 << 63) - 1


class OpenGroups:
    """The groups being answered now (streamed or collected), so that a shutdown whose drain time
    runs out can end them with a clean error instead of a cancelled task (cli's DrainingServer)."""

    def __init__(self) -> None:
        self._groups: set[GroupStream] = set()

    def add(self, stream: GroupStream) -> None:
        self._groups.add(stream)

    def discard(self, stream: GroupStream) -> None:
        self._groups.discard(stream)

    def end_all(self, message: str) -> int:
        """End each open group with EngineStopped(message) after the outputs it already has
        (a stream: an error event and [DONE]; a collected answer: 503 shutting_down)."""
        for stream in self._groups:
            stream.fail(EngineStopped(message))
        return len(self._groups)


@dataclass
class ServerContext:
    """Per-app state, built once at start-up."""

    config: ServerConfig
    engine: AsyncEngine
    metrics: ServerMetrics
    created: int
    tiers: list[TierDescriptor]
    """The engine's KV tiers in lookup order, as clients name and match them."""
    default_hints: KVHints
    """The server's hint defaults (default_kv_*, default_slo_*): each field a request does not
    send keeps its default."""
    open_groups: OpenGroups = dataclasses.field(default_factory=OpenGroups)


@dataclass
class Call:
    """One HTTP generation request on its way through the engine."""

    request_id: str
    """The X-Request-Id (the client's, or generated)."""
    hints: KVHints
    """The request's KV tier hints (headers and kv_transfer_params), checked."""
    created: int
    cache_scope: str | None = None
    """The caller's cache scope: its key's digest under cache_scope per-key, else None."""
    tenant: str | None = None
    """Whose share of the engine the call uses (fair share): its key's tenant, else None."""
    echo_kv: bool = False
    """The request sent kv_transfer_params: its answer echoes them as applied (vLLM's rule)."""


def context(request: Request) -> ServerContext:
    return request.app.state.ctx


def start_call(request: Request, body: _SamplingFields) -> Call:
    ctx = context(request)
    hints = parse_hints(request.headers, body.kv_transfer_params, ctx.tiers,
                        ctx.engine.max_model_len).over(ctx.default_hints)
    if hints.sparse_attention and not ctx.engine.info.sparse.enabled:
        raise bad_request("header X-Sparse-Attention: on, but sparse attention is not enabled on "
                          "this server (start it with --sparse-topk-blocks or --sparse-topk-ratio)",
                          "X-Sparse-Attention")
    if hints.speculative and ctx.engine.info.speculative is None:
        raise bad_request("header X-Speculative: on, but speculative decoding is not enabled on "
                          "this server (start it with --speculative-config)", "X-Speculative")
    return Call(request.state.request_id, hints, int(time.time()), _cache_scope(ctx, request),
                echo_kv=body.kv_transfer_params is not None, tenant=tenant_of(request))


def _cache_scope(ctx: ServerContext, request: Request) -> str | None:
    """Per key: a digest of the key's digest (so the scope a block hash mixes in is not the value
    the gate compares keys by). Shared, or a caller without a key: None."""
    who = caller(request)
    if not ctx.config.scope_per_key or who is None:
        return None
    return hashlib.sha256(b"tierserve cache scope|" + who.key_digest).hexdigest()


def kv_facts(ctx: ServerContext, call: Call, outputs: list[RequestOutput],
             n: int) -> tuple[dict[str, str], dict | None]:
    """What the tier policy did for a finished group: the X-KV-Policy and X-KV-Hit-Tokens
    headers (always) and the kv_transfer_params echo (see kv_echo). Hit tokens count each prompt
    once (as usage does); the policy is the first choice's (every choice of a request has the
    same hints)."""
    done = [o for o in outputs if o.kv_decision is not None]
    if not ctx.tiers or not done:
        return {}, None
    hits: dict[str, int] = {}
    for k, out in enumerate(outputs):
        if k % n == 0 and out.kv_hit_tokens:
            for tier, tokens in out.kv_hit_tokens.items():
                hits[tier] = hits.get(tier, 0) + tokens
    return {"X-KV-Policy": policy_header(done[0].kv_decision),
            "X-KV-Hit-Tokens": ",".join(f"{t}={v}" for t, v in hits.items())}, \
        kv_echo(ctx, call, done[0].kv_decision, hits)


def kv_echo(ctx: ServerContext, call: Call, decision: TierDecision | None,
            hits: dict[str, int] | None) -> dict | None:
    """kv_transfer_params as applied, with the policy in words and the hit tokens per cache;
    None (left out of the answer) unless the request sent kv_transfer_params."""
    if not ctx.tiers or decision is None or not call.echo_kv:
        return None
    echo = applied_params(call.hints, decision.load_tiers, decision.store_tiers, ctx.tiers)
    echo.update(kv_policy=policy_header(decision), kv_hit_tokens=hits or {})
    return echo


def check_model(ctx: ServerContext, model: str | None) -> None:
    names = ctx.config.model_names
    if model is not None and model not in names:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                            f"{', '.join(f'`{n}`' for n in names)} (see GET /v1/models).",
                       param="model", code="model_not_found")


def sampling_params(body: _SamplingFields, ctx: ServerContext, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    """Range checks happen in SamplingParams; the server adds the ones that protect itself."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= ctx.config.max_n:
        raise bad_request(f"n must be in [1, {ctx.config.max_n}], got {n}", "n")
    if body.seed is not None and not -_INT64 - 1 <= body.seed <= _INT64:
        raise bad_request(f"seed must fit in a signed 64-bit integer, got {body.seed}", "seed")
    if body.priority is not None and not -_INT64 - 1 <= body.priority <= _INT64:
        raise bad_request("priority must fit in a signed 64-bit integer", "priority")
    max_tokens = _limited_max_tokens(body, ctx.config.max_tokens_limit, max_tokens)
    vocab = ctx.engine.tokenizer.vocab_size
    stop_ids = list(body.stop_token_ids or [])
    bad = next((t for t in stop_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"stop_token_ids: token id {bad} is out of range [0, {vocab})",
                          "stop_token_ids")
    top_k = body.top_k
    if top_k is not None and top_k > vocab:
        top_k = vocab  # keeping more than the vocabulary is keeping all of it
    try:
        return SamplingParams(
            n=n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k is None else top_k,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias, vocab),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens or 0,
            ignore_eos=bool(body.ignore_eos),
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            stop_token_ids=stop_ids,
            include_stop_str_in_output=bool(body.include_stop_str_in_output),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens is not False,
            structured_outputs=structured,
        )
    except ParamError as e:
        raise bad_request(str(e), e.param) from None


def _limited_max_tokens(body: _SamplingFields, limit: int | None,
                        max_tokens: int | None) -> int | None:
    """max_tokens_limit: asking for more is a 400 naming the field the client sent; the schema's
    default (16 on completions) is capped instead. None (chat: up to the context) is capped per
    prompt at admission, where the prompt's length is known."""
    if limit is None or max_tokens is None or max_tokens <= limit:
        return max_tokens
    name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None \
        else "max_tokens"
    if name not in body.model_fields_set:
        return limit
    raise bad_request(f"{name} must be in [1, {limit}], got {max_tokens}", name)


def _check_prompt_lengths(ctx: ServerContext, prompts: list[list[int]],
                          body: _SamplingFields) -> None:
    limit = ctx.config.max_prompt_tokens
    if limit is None:
        return
    name = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            which = f"{name}[{i}]" if len(prompts) > 1 else name
            raise bad_request(f"{which} has {len(ids)} tokens; this server accepts at most {limit} "
                              f"prompt tokens (max_prompt_tokens)", name)


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if not 0 <= tid < vocab:
            raise bad_request(f"logit_bias token id {tid} is out of range [0, {vocab})", "logit_bias")
        out[tid] = v
    return out


def admit(ctx: ServerContext, call: Call, prompts: list[list[int]], params: SamplingParams,
          body: _SamplingFields) -> GroupStream:
    """Fan out to one engine request per (prompt, choice): child k = prompt k // n, choice k % n."""
    _check_prompt_lengths(ctx, prompts, body)
    total, limit = len(prompts) * params.n, ctx.engine.max_in_flight
    if total > limit:  # no retry could ever succeed: a 400, not a 429
        raise bad_request(f"{len(prompts)} prompt(s) x n={params.n} = {total} sequences; the server "
                          f"holds at most {limit} at once (max_num_seqs + max_queue)",
                          "n" if params.n > 1 else "prompt", code="never_admissible")
    base = uuid.uuid4().hex
    children = []
    for p, ids in enumerate(prompts):
        max_tokens = _default_cap(ctx, ids, params.max_tokens)
        for j in range(params.n):
            child = dataclasses.replace(params, n=1, max_tokens=max_tokens,
                                        seed=None if params.seed is None else params.seed + j)
            children.append(ChildRequest(f"{base}-{p * params.n + j}", ids, child,
                                         body.priority or 0, body.cache_salt,
                                         None if call.hints.empty else call.hints,
                                         call.cache_scope, tenant=call.tenant))
    try:
        stream = ctx.engine.add_group(children)
    except ParamError as e:
        raise bad_request(str(e), e.param) from None
    except QueueFull as e:
        raise ApiError(429, f"The server is at capacity: {e}. Retry later.",
                       type_="rate_limit_exceeded", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except EngineStopped as e:
        raise ApiError(503, str(e), type_="server_error", code="shutting_down") from None
    return stream


def _default_cap(ctx: ServerContext, ids: list[int], max_tokens: int | None) -> int | None:
    """A request that names no max_tokens gets what the context leaves, at most max_tokens_limit."""
    limit, room = ctx.config.max_tokens_limit, ctx.engine.max_model_len - len(ids)
    if max_tokens is not None or limit is None or room < 1:
        return max_tokens  # room < 1: the engine's prompt check answers
    return min(limit, room)


async def observed(stream: GroupStream, obs: RequestObserver) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for i, out in stream:
        obs.on_output(i, out)
        yield i, out


async def collect(ctx: ServerContext, stream: GroupStream, request: Request) -> list[RequestOutput]:
    """The final output of every child; aborts the group if the client goes away meanwhile."""
    final: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async for i, out in observed(stream, ctx.metrics.observer()):
            if out.finished:
                final[i] = out

    task = asyncio.ensure_future(consume())
    ctx.open_groups.add(stream)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                if task.exception() is not None:
                    raise engine_failure(task.exception())
                break
            if await request.is_disconnected():
                raise ApiError(499, "client disconnected", code="client_closed")
    finally:
        ctx.open_groups.discard(stream)
        if not task.done():
            task.cancel()
        abort(ctx, stream)  # what is unfinished: the client left, or the group failed
    return [final[i] for i in range(len(stream.children))]


def abort(ctx: ServerContext, stream: GroupStream) -> None:
    """The client went away: abort what is unfinished (its blocks return to the pool)."""
    if not stream.finished:
        ctx.metrics.success.labels(ctx.metrics.model, "abort").inc(len(stream.unfinished))
        ctx.engine.abort(stream)


def engine_failure(exc: BaseException) -> ApiError:
    if isinstance(exc, ParamError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, EngineStopped):
        return ApiError(503, str(exc), type_="server_error", code="shutting_down")
    return ApiError(500, "internal server error", type_="server_error", code="internal_error")
