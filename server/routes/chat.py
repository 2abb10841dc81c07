"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from tierserve.engine.outputs import RequestOutput
from tierserve.engine.worker.sampler import TopLogprobs
from tierserve.engine.tokenizer import TEMPLATE_VARIABLES
from tierserve.server.body import CheckedRoute
from tierserve.server.deltas import Delta, token_infos, usage_of
from tierserve.server.errors import bad_request
from tierserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatMessage, ChoiceLogprobs,
                                       DeltaMessage, TokenLogprob, TopLogprob, Usage)
from tierserve.server.serving import (Call, ServerContext, admit, check_model, collect, context,
                                      kv_echo, kv_facts, sampling_params, start_call)
from tierserve.server.streaming import sse_stream

router = APIRouter(route_class=CheckedRoute)

_ROLES = ("system", "developer", "user", "assistant")


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 response: Response):
    ctx, call = context(request), start_call(request, body)
    check_model(ctx, body.model)
    _reject_unsupported(body)
    ids = [render_chat(ctx, body.messages, body.add_generation_prompt is not False,
                       body.chat_template_kwargs)]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    params = sampling_params(body, ctx, max_tokens, (top or 0) if body.logprobs else None)
    stream = admit(ctx, call, ids, params, body)
    if body.stream:
        fmt = _ChatFormat(ctx, call, body, len(stream.children))
        return StreamingResponse(sse_stream(ctx, call, stream, fmt, body.stream_options),
                                 media_type="text/event-stream")
    outputs = await collect(ctx, stream, request)
    choices = [_choice(ctx, k, out, body) for k, out in enumerate(outputs)]
    headers, echo = kv_facts(ctx, call, outputs, params.n)
    response.headers.update(headers)
    return ChatCompletionResponse(id=f"chatcmpl-{call.request_id}", created=call.created,
                                  model=ctx.config.model_name, choices=choices,
                                  usage=usage_of(outputs, params.n), kv_transfer_params=echo)


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


def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                template_kwargs: dict | None = None) -> list[int]:
    """Messages -> prompt token ids through the chat template; `template_kwargs` are more
    variables for it (they may not replace the ones the server sets)."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    taken = sorted(set(template_kwargs or {}) & set(TEMPLATE_VARIABLES))
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {taken}: the server sets them",
                          f"chat_template_kwargs.{taken[0]}")
    plain = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise bad_request(f"messages[{i}].role {m.role!r} is not supported; use one of "
                              f"{list(_ROLES)}", f"messages[{i}].role")
        plain.append({"role": "system" if m.role == "developer" else m.role,
                      "content": _content(m, i)})
    tok = ctx.engine.tokenizer
    try:
        text = tok.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                       **(template_kwargs or {}))
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
    def entry(token: str, logprob: float):
        return dict(token=token, logprob=logprob, bytes=list(token.encode()))

    return ChoiceLogprobs(content=[
        TokenLogprob(**entry(t.token, t.logprob),
                     top_logprobs=[TopLogprob(**entry(s, v)) for s, v in t.top])
        for t in token_infos(ctx.engine.tokenizer, ids, lps)])


def _choice(ctx: ServerContext, k: int, out: RequestOutput, body: ChatCompletionRequest) -> ChatChoice:
    c = out.outputs[0] if out.outputs else None
    lp = None
    if body.logprobs and c is not None and c.logprobs is not None:
        lp = _logprobs(ctx, c.token_ids, c.logprobs)
    return ChatChoice(index=k, message=AssistantMessage(content=c.text if c else ""), logprobs=lp,
                      finish_reason=c.finish_reason if c else "abort",
                      stop_reason=c.stop_reason if c else None)


class _ChatFormat:
    """Chat chunks: the assistant role first (as OpenAI sends it), then content deltas."""

    def __init__(self, ctx: ServerContext, call: Call, body: ChatCompletionRequest, num_choices: int):
        self.ctx, self.call, self.body, self.num_choices = ctx, call, body, num_choices
        self.base = dict(id=f"chatcmpl-{call.request_id}", created=call.created,
                         model=ctx.config.model_name)

    def opening(self) -> list[ChatCompletionChunk]:
        return [ChatCompletionChunk(choices=[ChatChunkChoice(
            index=k, delta=DeltaMessage(role="assistant", content=""))], **self.base)
            for k in range(self.num_choices)]

    def prompt_index(self, k: int) -> int:
        return 0

    def chunk(self, k: int, d: Delta) -> ChatCompletionChunk | None:
        lp = None
        if self.body.logprobs and d.logprobs is not None and d.token_ids:
            lp = _logprobs(self.ctx, d.token_ids, d.logprobs)
        if not d.text and d.finish_reason is None and lp is None:
            return None
        choice = ChatChunkChoice(index=k, delta=DeltaMessage(content=d.text or None), logprobs=lp,
                                 finish_reason=d.finish_reason, stop_reason=d.stop_reason)
        return ChatCompletionChunk(choices=[choice], **self.base, kv_transfer_params=kv_echo(
            self.ctx, self.call, d.kv_decision, d.kv_hit_tokens))

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(choices=[], usage=usage, **self.base)
