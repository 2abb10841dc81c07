"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tierserve.engine.async_engine import GroupStream
from tierserve.engine.outputs import RequestOutput
from tierserve.engine.sampler import TopLogprobs
from tierserve.server.deltas import SSE_DONE, DeltaTracker, sse, usage_of
from tierserve.server.errors import ApiError, bad_request, error_json
from tierserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                       ChatMessage, ChoiceLogprobs, DeltaMessage, TokenLogprob, TopLogprob)
from tierserve.server.serving import (Call, ServerContext, abort, admit, check_model, collect, context,
                                      engine_failure, observed, sampling_params, start_call)

router = APIRouter()

_ROLES = ("system", "developer", "user", "assistant")


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    ctx, call = context(request), start_call(request)
    check_model(ctx, body.model)
    _reject_unsupported(body)
    ids = [render_chat(ctx, body.messages, body.add_generation_prompt is not False)]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    params = sampling_params(body, ctx, max_tokens, (top or 0) if body.logprobs else None)
    stream = admit(ctx, call, ids, params, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, call, stream, body, include_usage),
                                 media_type="text/event-stream")
    outputs = await collect(ctx, stream, request)
    choices = [_choice(ctx, k, out, body) for k, out in enumerate(outputs)]
    return ChatCompletionResponse(id=f"chatcmpl-{call.request_id}", created=call.created,
                                  model=ctx.config.model_name, choices=choices,
                                  usage=usage_of(outputs, params.n))


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise bad_request(f"{name} are not supported yet", name, code="unsupported_parameter")
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise bad_request(f"{name} is not supported yet", name, code="unsupported_parameter")
    fmt = body.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        raise bad_request(f"response_format type {fmt.get('type')!r} is not supported yet; "
                          "only 'text'", "response_format", code="unsupported_parameter")


def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Messages -> prompt token ids through the model's chat template."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    plain = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise bad_request(f"messages[{i}].role {m.role!r} is not supported; use one of "
                              f"{list(_ROLES)}", f"messages[{i}].role")
        plain.append({"role": "system" if m.role == "developer" else m.role,
                      "content": _content(m, i)})
    tok = ctx.engine.tokenizer
    try:
        text = tok.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise bad_request(f"messages could not be rendered with the chat template: {e}",
                          "messages") from None
    return tok.encode(text, add_special_tokens=False)


def _content(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for j, p in enumerate(m.content):
        if p.type != "text" or p.text is None:
            raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported, got "
                              f"type {p.type!r}", f"messages[{i}].content")
        parts.append(p.text)
    return "".join(parts)


def _logprobs(ctx: ServerContext, ids: list[int], lps: list[TopLogprobs]) -> ChoiceLogprobs:
    tok = ctx.engine.tokenizer
    content = []
    for tid, lp in zip(ids, lps):
        s = tok.decode([tid], skip_special_tokens=False)
        top = [TopLogprob(token=(t := tok.decode([i], skip_special_tokens=False)), logprob=v,
                          bytes=list(t.encode())) for i, v in lp.top]
        content.append(TokenLogprob(token=s, logprob=lp.logprob, bytes=list(s.encode()),
                                    top_logprobs=top))
    return ChoiceLogprobs(content=content)


def _choice(ctx: ServerContext, k: int, out: RequestOutput, body: ChatCompletionRequest) -> ChatChoice:
    c = out.outputs[0] if out.outputs else None
    lp = None
    if body.logprobs and c is not None and c.logprobs is not None:
        lp = _logprobs(ctx, c.token_ids, c.logprobs)
    return ChatChoice(index=k, message=AssistantMessage(content=c.text if c else ""), logprobs=lp,
                      finish_reason=c.finish_reason if c else "abort",
                      stop_reason=c.stop_reason if c else None)


async def _stream(ctx: ServerContext, call: Call, stream: GroupStream,
                  body: ChatCompletionRequest, include_usage: bool) -> AsyncIterator[str]:
    tracker = DeltaTracker(len(stream.children))
    base = dict(id=f"chatcmpl-{call.request_id}", created=call.created,
                model=ctx.config.model_name)
    try:
        for k in range(len(stream.children)):  # the role first, as OpenAI does
            first = ChatChunkChoice(index=k, delta=DeltaMessage(role="assistant", content=""))
            yield sse(ChatCompletionChunk(choices=[first], **base).model_dump_json())
        async for k, out in observed(stream, ctx.metrics.observer()):
            d = tracker.delta(k, out, 0)
            lp = None
            if body.logprobs and d.logprobs is not None and d.token_ids:
                lp = _logprobs(ctx, d.token_ids, d.logprobs)
            if not d.text and d.finish_reason is None and lp is None:
                continue
            delta = DeltaMessage(content=d.text if d.text else None)
            choice = ChatChunkChoice(index=k, delta=delta, logprobs=lp,
                                     finish_reason=d.finish_reason, stop_reason=d.stop_reason)
            yield sse(ChatCompletionChunk(choices=[choice], **base).model_dump_json())
        if include_usage:
            yield sse(ChatCompletionChunk(choices=[], usage=tracker.usage(), **base).model_dump_json())
    except ApiError as e:
        yield sse(error_json(e))
    except Exception as e:  # noqa: BLE001 - reported as an error event, no trace
        yield sse(error_json(engine_failure(e)))
    finally:
        abort(ctx, stream)
    yield SSE_DONE
