"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from tierserve.engine.api import TEMPLATE_VARIABLES, RequestOutput, TopLogprobs
from tierserve.server.body import CheckedRoute
from tierserve.server.deltas import Delta, token_infos, usage_of
from tierserve.server.errors import bad_request
from tierserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatMessage, ChoiceLogprobs,
                                       DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                       FunctionCall, TokenLogprob, ToolCall, TopLogprob, Usage)
from tierserve.server.serving import (Call, ServerContext, admit, check_model, collect, context,
                                      kv_echo, kv_facts, sampling_params, start_call)
from tierserve.server.streaming import sse_stream
from tierserve.server.structured import Constraint, compile_checked, requested
from tierserve.server.tool_parsers import ToolCallDelta, ToolParser
from tierserve.server.tools import ToolPlan, call_id, plan_tools, template_messages

router = APIRouter(route_class=CheckedRoute)

_ROLES = ("system", "developer", "user", "assistant", "tool")


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 response: Response):
    ctx, call = context(request), start_call(request, body)
    check_model(ctx, body.model)
    _reject_unsupported(body)
    cfg = ctx.config
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                      cfg.enable_auto_tool_choice, cfg.tool_call_parser)
    constraint = _constraint(body, plan)
    for c in (plan.schema_constraints() if plan else []) + ([constraint] if constraint else []):
        await compile_checked(ctx.engine, c, cfg.grammar_compile_timeout_s, call.cache_scope,
                              request)
    ids = [render_chat(ctx, body.messages, body.add_generation_prompt is not False,
                       body.chat_template_kwargs, plan)]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    params = sampling_params(body, ctx, max_tokens, (top or 0) if body.logprobs else None,
                             structured=constraint.spec if constraint else None)
    stream = admit(ctx, call, ids, params, body)
    if body.stream:
        fmt = _ChatFormat(ctx, call, body, len(stream.children), plan)
        return StreamingResponse(sse_stream(ctx, call, stream, fmt, body.stream_options),
                                 media_type="text/event-stream")
    outputs = await collect(ctx, stream, request)
    choices = [_choice(ctx, k, out, body, plan) for k, out in enumerate(outputs)]
    headers, echo = kv_facts(ctx, call, outputs, params.n)
    response.headers.update(headers)
    return ChatCompletionResponse(id=f"chatcmpl-{call.request_id}", created=call.created,
                                  model=ctx.config.model_name, choices=choices,
                                  usage=usage_of(outputs, params.n), kv_transfer_params=echo)


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    if body.functions:
        raise bad_request("functions (deprecated by OpenAI) are not supported; send tools",
                          "functions", code="unsupported_parameter")
    if body.function_call not in (None, "none"):
        raise bad_request("function_call (deprecated by OpenAI) is not supported; send "
                          "tool_choice", "function_call", code="unsupported_parameter")


def _constraint(body: ChatCompletionRequest, plan: ToolPlan | None) -> Constraint | None:
    """The output's one constraint: the body's structured-output fields, or the tools' grammar
    (tool_choice required or a named function); both at once is a 400."""
    asked = requested(body)
    if plan is None or plan.constraint is None:
        return asked
    if asked is not None:
        raise bad_request(f"{asked.param} cannot be combined with tool_choice "
                          f"{body.tool_choice!r}: both constrain the output", "tool_choice")
    return plan.constraint


def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                template_kwargs: dict | None = None, plan: ToolPlan | None = None) -> list[int]:
    """Messages -> prompt token ids through the chat template; `template_kwargs` are more
    variables for it (they may not replace the ones the server sets). Tools reach the template
    as server/tools.py says."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    reserved = TEMPLATE_VARIABLES + (("tools",) if plan else ())
    taken = sorted(set(template_kwargs or {}) & set(reserved))
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {taken}: the server sets them",
                          f"chat_template_kwargs.{taken[0]}")
    plain = [_plain(m, i) for i, m in enumerate(messages)]
    tok = ctx.engine.tokenizer
    plain, variables = template_messages(plan, plain, tok.takes_tools)
    try:
        text = tok.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                       **(template_kwargs or {}), **variables)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise bad_request(f"messages could not be rendered with the chat template: {e}",
                          "messages") from None
    return tok.encode(text, add_special_tokens=False)


def _plain(m: ChatMessage, i: int) -> dict:
    """One turn as the template reads it (developer is system; tool turns keep their call id)."""
    if m.role not in _ROLES:
        raise bad_request(f"messages[{i}].role {m.role!r} is not supported; use one of "
                          f"{list(_ROLES)}", f"messages[{i}].role")
    out = {"role": "system" if m.role == "developer" else m.role, "content": _content(m, i)}
    if m.tool_calls:
        if m.role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls: only assistant turns make tool calls",
                              f"messages[{i}].tool_calls")
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.role == "tool":
        if not m.tool_call_id:
            raise bad_request(f"messages[{i}].tool_call_id is required in a tool turn",
                              f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


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


def _choice(ctx: ServerContext, k: int, out: RequestOutput, body: ChatCompletionRequest,
            plan: ToolPlan | None) -> ChatChoice:
    c = out.outputs[0] if out.outputs else None
    lp = None
    if body.logprobs and c is not None and c.logprobs is not None:
        lp = _logprobs(ctx, c.token_ids, c.logprobs)
    text, finish = (c.text, c.finish_reason) if c else ("", "abort")
    message = AssistantMessage(content=text)
    if plan is not None and plan.parser is not None:
        parsed = plan.parser.parse(text)
        message = AssistantMessage(content=parsed.content, tool_calls=[
            ToolCall(id=call_id(), function=FunctionCall(name=t.name, arguments=t.arguments))
            for t in parsed.calls])
        if parsed.calls and finish == "stop":
            finish = "tool_calls"
    return ChatChoice(index=k, message=message, logprobs=lp, finish_reason=finish,
                      stop_reason=c.stop_reason if c else None)


class _ChatFormat:
    """Chat chunks: the assistant role first (as OpenAI sends it), then content deltas."""

    def __init__(self, ctx: ServerContext, call: Call, body: ChatCompletionRequest, num_choices: int,
                 plan: ToolPlan | None = None):
        self.ctx, self.call, self.body, self.num_choices = ctx, call, body, num_choices
        self.base = dict(id=f"chatcmpl-{call.request_id}", created=call.created,
                         model=ctx.config.model_name)
        parser = plan.parser if plan is not None else None
        self.tools = [_ToolStream(parser) for _ in range(num_choices)] if parser else None
        """Per choice: the tool-call parser over its text (content and tool-call deltas)."""

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
        text, calls, finish = d.text, None, d.finish_reason
        if self.tools is not None:
            text, calls, finish = self.tools[k].feed(d.text, d.finish_reason)
        if not text and not calls and finish is None and lp is None:
            return None
        choice = ChatChunkChoice(index=k, delta=DeltaMessage(content=text or None, tool_calls=calls),
                                 logprobs=lp, finish_reason=finish, stop_reason=d.stop_reason)
        return ChatCompletionChunk(choices=[choice], **self.base, kv_transfer_params=kv_echo(
            self.ctx, self.call, d.kv_decision, d.kv_hit_tokens))

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(choices=[], usage=usage, **self.base)


class _ToolStream:
    """One choice's text through the tool-call parser: content it lets through, then each call
    as OpenAI streams it (id, type and name first; then argument fragments)."""

    def __init__(self, parser: ToolParser):
        self.stream = parser.streamer()
        self.ids: dict[int, str] = {}

    def feed(self, text: str, finish: str | None) -> tuple[str, list[DeltaToolCall] | None, str | None]:
        content, deltas = self.stream.feed(text) if text else ("", [])
        if finish is not None:
            more, rest = self.stream.finish()
            content, deltas = content + more, deltas + rest
        calls = [self._delta(d) for d in deltas]
        if finish == "stop" and self.stream.calls:
            finish = "tool_calls"
        return content, calls or None, finish

    def _delta(self, d: ToolCallDelta) -> DeltaToolCall:
        if d.name is None:
            return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
        self.ids[d.index] = call_id()
        return DeltaToolCall(index=d.index, id=self.ids[d.index], type="function",
                             function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
