"""The one streaming skeleton of /v1/completions and /v1/chat/completions.

    opening chunks (chat: the assistant role) -> a chunk per delta -> the usage chunk
    -> [DONE]; an error becomes an error event (logged with its traceback first); the group
    is aborted whenever the generator ends early (the client went away), freeing its blocks.
    A shutdown whose drain time runs out ends each open stream through ServerContext.open_groups:
    an error event (shutting_down, logged as one line), then [DONE].

A route supplies a StreamFormat: what to send first, how a delta becomes a chunk, and the usage
chunk. The skeleton owns everything else."""

from __future__ import annotations

import logging
from typing import AsyncIterator, Protocol

from pydantic import BaseModel

from tierserve.engine.api import EngineStopped, GroupStream
from tierserve.server.deltas import SSE_DONE, Delta, DeltaTracker, sse
from tierserve.server.errors import ApiError, error_json
from tierserve.server.protocol import StreamOptions, Usage
from tierserve.server.serving import Call, ServerContext, abort, engine_failure, observed

log = logging.getLogger(__name__)


class StreamFormat(Protocol):
    def opening(self) -> list[BaseModel]:
        """Chunks sent before any token."""

    def prompt_index(self, k: int) -> int:
        """The prompt that choice k continues (usage counts each prompt once)."""

    def chunk(self, k: int, d: Delta) -> BaseModel | None:
        """The chunk for choice k's delta, or None when there is nothing to send yet."""

    def usage_chunk(self, usage: Usage) -> BaseModel:
        """The closing chunk with no choices and the whole usage."""


async def sse_stream(ctx: ServerContext, call: Call, stream: GroupStream, fmt: StreamFormat,
                     options: StreamOptions | None) -> AsyncIterator[str]:
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)
    tracker = DeltaTracker(len(stream.children))
    for k, child in enumerate(stream.children):  # usage counts the prompts from the first chunk
        tracker.prompt_tokens.setdefault(fmt.prompt_index(k), len(child.prompt_token_ids))
    ctx.open_groups.add(stream)
    try:
        for chunk in fmt.opening():
            yield _event(chunk, tracker.usage() if continuous else None)
        async for k, out in observed(stream, ctx.metrics.observer()):
            chunk = fmt.chunk(k, tracker.delta(k, out, fmt.prompt_index(k)))
            if chunk is not None:
                yield _event(chunk, tracker.usage() if continuous else None)
        if include_usage:
            yield sse(fmt.usage_chunk(tracker.usage()).model_dump_json())
    except ApiError as e:
        log.warning("stream of request %s ended with %d: %s", call.request_id, e.status, e.message)
        yield sse(error_json(e))
    except EngineStopped as e:  # shutting down, or the loop is gone (it logged why): no traceback
        log.warning("stream of request %s ended: %s", call.request_id, e)
        yield sse(error_json(engine_failure(e)))
    except Exception as e:  # noqa: BLE001 - logged here; the client gets an error event
        log.exception("stream of request %s failed", call.request_id)
        yield sse(error_json(engine_failure(e)))
    finally:
        ctx.open_groups.discard(stream)
        abort(ctx, stream)
    yield SSE_DONE


def _event(chunk: BaseModel, usage: Usage | None) -> str:
    if usage is not None:
        chunk.usage = usage
    return sse(chunk.model_dump_json())
