"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from tierserve.engine.api import RequestOutput, TopLogprobs
from tierserve.server.body import CheckedRoute
from tierserve.server.deltas import Delta, token_infos, usage_of
from tierserve.server.errors import bad_request
from tierserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                       CompletionResponse, Usage)
from tierserve.server.serving import (Call, ServerContext, admit, check_model, collect, context,
                                      kv_echo, kv_facts, sampling_params, start_call)
from tierserve.server.streaming import sse_stream
from tierserve.server.structured import compile_checked, requested

router = APIRouter(route_class=CheckedRoute)


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request, response: Response):
    ctx, call = context(request), start_call(request, body)
    check_model(ctx, body.model)
    if body.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of is not supported (it must equal n when given)", "best_of")
    prompts, texts = _prompts(ctx, body.prompt)
    echo_lps = body.logprobs if body.echo and body.logprobs is not None else None
    constraint = requested(body)
    if constraint is not None:
        await compile_checked(ctx.engine, constraint, ctx.config.grammar_compile_timeout_s,
                              call.cache_scope, request)
    params = sampling_params(body, ctx, body.max_tokens, body.logprobs, echo_lps,
                             structured=constraint.spec if constraint else None)
    stream = admit(ctx, call, prompts, params, body)
    if body.stream:
        fmt = _CompletionFormat(ctx, call, body, texts, len(stream.children))
        return StreamingResponse(sse_stream(ctx, call, stream, fmt, body.stream_options),
                                 media_type="text/event-stream")
    outputs = await collect(ctx, stream, request)
    n = params.n
    choices = [_choice(ctx, k, out, body, texts[k // n], prompts[k // n])
               for k, out in enumerate(outputs)]
    headers, echo = kv_facts(ctx, call, outputs, n)
    response.headers.update(headers)
    return CompletionResponse(id=f"cmpl-{call.request_id}", created=call.created,
                              model=ctx.config.model_name, choices=choices,
                              usage=usage_of(outputs, n), kv_transfer_params=echo)


def _prompts(ctx: ServerContext, prompt) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (a string, strings, token ids or lists of token ids)."""
    tok = ctx.engine.tokenizer
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if len(prompt) > ctx.config.max_prompts:
        raise bad_request(f"at most {ctx.config.max_prompts} prompts per request, got "
                          f"{len(prompt)}", "prompt")
    ids, texts = [], []
    vocab = tok.vocab_size
    for p in prompt:
        if isinstance(p, str):
            ids.append(tok.encode(p))
            texts.append(p)
        else:
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"prompt: token id {bad} is out of range [0, {vocab})", "prompt")
            ids.append(list(p))
            texts.append(tok.decode(p, skip_special_tokens=False))
    return ids, texts


def _logprobs(ctx: ServerContext, ids: list[int], lps: list[TopLogprobs | None],
              offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for t in token_infos(ctx.engine.tokenizer, ids, lps):
        out.tokens.append(t.token)
        out.text_offset.append(offset)
        offset += len(t.token)
        out.token_logprobs.append(t.logprob)
        if t.logprob is None:
            out.top_logprobs.append(None)
            continue
        top = dict(t.top)
        top.setdefault(t.token, t.logprob)
        out.top_logprobs.append(top)
    return out


def _choice(ctx: ServerContext, k: int, out: RequestOutput, body: CompletionRequest, text: str,
            prompt_ids: list[int]) -> CompletionChoice:
    c = out.outputs[0] if out.outputs else None
    gen = c.text if c else ""
    prefix = text if body.echo else ""
    lp = None
    if body.logprobs is not None:
        lp = CompletionLogprobs()
        if body.echo and out.prompt_logprobs is not None:
            lp = _logprobs(ctx, prompt_ids, list(out.prompt_logprobs), 0)
        if c is not None and c.logprobs is not None:
            more = _logprobs(ctx, c.token_ids, c.logprobs, len(prefix))
            for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(lp, f).extend(getattr(more, f))
    return CompletionChoice(index=k, text=prefix + gen, logprobs=lp,
                            finish_reason=c.finish_reason if c else "abort",
                            stop_reason=c.stop_reason if c else None)


class _CompletionFormat:
    """Completion chunks: text deltas (the prompt first when echoing), logprobs with offsets."""

    def __init__(self, ctx: ServerContext, call: Call, body: CompletionRequest, texts: list[str],
                 num_choices: int):
        self.ctx, self.call, self.body, self.texts = ctx, call, body, texts
        self.n = body.n or 1
        self.sent = [0] * num_choices  # characters of each choice sent (for text_offset)
        self.base = dict(id=f"cmpl-{call.request_id}", created=call.created,
                         model=ctx.config.model_name)

    def opening(self) -> list:
        return []

    def prompt_index(self, k: int) -> int:
        return k // self.n

    def chunk(self, k: int, d: Delta) -> CompletionResponse | None:
        text = (self.texts[k // self.n] if self.body.echo and d.first else "") + d.text
        lp = None
        if self.body.logprobs is not None and d.logprobs is not None:
            lp = _logprobs(self.ctx, d.token_ids, d.logprobs, self.sent[k] + len(text) - len(d.text))
        if not text and d.finish_reason is None and lp is None:
            return None
        self.sent[k] += len(text)
        choice = CompletionChoice(index=k, text=text, logprobs=lp,
                                  finish_reason=d.finish_reason, stop_reason=d.stop_reason)
        return CompletionResponse(choices=[choice], **self.base, kv_transfer_params=kv_echo(
            self.ctx, self.call, d.kv_decision, d.kv_hit_tokens))

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(choices=[], usage=usage, **self.base)
