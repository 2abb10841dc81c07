"""POST /v1/completions."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tierserve.engine.async_engine import GroupStream
from tierserve.engine.outputs import RequestOutput
from tierserve.engine.sampler import TopLogprobs
from tierserve.server.deltas import SSE_DONE, DeltaTracker, sse, usage_of
from tierserve.server.errors import ApiError, bad_request, error_json
from tierserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                       CompletionResponse)
from tierserve.server.serving import (Call, ServerContext, abort, admit, check_model, collect, context,
                                      engine_failure, observed, sampling_params, start_call)

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request):
    ctx, call = context(request), start_call(request)
    check_model(ctx, body.model)
    if body.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of is not supported (it must equal n when given)", "best_of")
    prompts, texts = _prompts(ctx, body.prompt)
    echo_lps = body.logprobs if body.echo and body.logprobs is not None else None
    params = sampling_params(body, ctx, body.max_tokens, body.logprobs, echo_lps)
    stream = admit(ctx, call, prompts, params, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _stream(ctx, call, stream, body, texts, prompts, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream")
    outputs = await collect(ctx, stream, request)
    n = params.n
    choices = [_choice(ctx, k, out, body, texts[k // n], prompts[k // n])
               for k, out in enumerate(outputs)]
    return CompletionResponse(id=f"cmpl-{call.request_id}", created=call.created,
                              model=ctx.config.model_name, choices=choices,
                              usage=usage_of(outputs, n))


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
                raise bad_request(f"token id {bad} is out of range [0, {vocab})", "prompt")
            ids.append(list(p))
            texts.append(tok.decode(p, skip_special_tokens=False))
    return ids, texts


def _token_str(ctx: ServerContext, tid: int) -> str:
    return ctx.engine.tokenizer.decode([tid], skip_special_tokens=False)


def _logprobs(ctx: ServerContext, ids: list[int], lps: list[TopLogprobs | None],
              offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for tid, lp in zip(ids, lps):
        s = _token_str(ctx, tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if lp is None:  # the first prompt token has no logprob
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.logprob)
        top = {_token_str(ctx, t): v for t, v in lp.top}
        top.setdefault(s, lp.logprob)
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


async def _stream(ctx: ServerContext, call: Call, stream: GroupStream, body: CompletionRequest,
                  texts: list[str], prompts: list[list[int]], include_usage: bool) -> AsyncIterator[str]:
    n = body.n or 1
    tracker = DeltaTracker(len(stream.children))
    sent = [0] * len(stream.children)  # characters of each choice sent (for text_offset)
    base = dict(id=f"cmpl-{call.request_id}", created=call.created, model=ctx.config.model_name)
    try:
        async for k, out in observed(stream, ctx.metrics.observer()):
            d = tracker.delta(k, out, k // n)
            text = (texts[k // n] if body.echo and d.first else "") + d.text
            lp = None
            if body.logprobs is not None and d.logprobs is not None:
                lp = _logprobs(ctx, d.token_ids, d.logprobs, sent[k] + len(text) - len(d.text))
            if not text and d.finish_reason is None and lp is None:
                continue
            sent[k] += len(text)
            choice = CompletionChoice(index=k, text=text, logprobs=lp,
                                      finish_reason=d.finish_reason, stop_reason=d.stop_reason)
            chunk = CompletionResponse(choices=[choice], **base)
            yield sse(chunk.model_dump_json())
        if include_usage:
            yield sse(CompletionResponse(choices=[], usage=tracker.usage(), **base).model_dump_json())
    except ApiError as e:
        yield sse(error_json(e))
    except Exception as e:  # noqa: BLE001 - reported to the client as an error event, no trace
        err = engine_failure(e)
        yield sse(error_json(err))
    finally:
        abort(ctx, stream)
    yield SSE_DONE
