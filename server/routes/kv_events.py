"""GET /v1/kv/events: the KV tiers' events (BlockStored, BlockRemoved, AllBlocksCleared) as
server-sent events, for routers that track where each prefix is cached.

An operator route: it sees every tenant's cache activity, so with API keys configured it needs
an admin key (server/auth.py). Events carry block hashes, never token ids, unless the server was
started with --kv-events-token-ids.

    id: <seq>
    data: {"seq": <seq>, "ts": <unix time>, "type": "BlockStored", ...vLLM's fields}

A reader starts after `?since=N` (or the Last-Event-ID header an EventSource sends when it
reconnects; the header wins), gets every buffered event past it, then new ones as they come, and
a `: keep-alive` comment when nothing was sent for KEEPALIVE_S. If the ring already dropped some
of the events it asked for, an `EventsDropped` event with their seq range comes first (its id is
the last lost seq, so a resume does not ask for them again). A `since` past the newest event
(a resume point from an earlier run of the server) replays the whole buffer.

The loop polls the log (an int compare) every POLL_S rather than waiting on its condition in a
thread: an idle reader holds no thread, and a gone client or a draining server ends the stream
within one poll.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from tierserve.engine.api import EventLog
from tierserve.server.auth import require_operator
from tierserve.server.body import CheckedRoute
from tierserve.server.errors import ApiError, bad_request
from tierserve.server.serving import ServerContext, context

router = APIRouter(route_class=CheckedRoute)

KEEPALIVE_S = 15.0
POLL_S = 0.1


@router.get("/v1/kv/events")
async def kv_events(request: Request, since: int = Query(
        0, ge=0, description="Send the events with a larger seq (0: all that are buffered).")):
    require_operator(request)
    ctx = context(request)
    log = _event_log(ctx)
    return StreamingResponse(_stream(request, ctx, log, _resume_point(request, since)),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event_log(ctx: ServerContext) -> EventLog:
    events = ctx.engine.info.events
    if events is None:
        raise ApiError(404, "no KV tiers configured (--kv-tiers none): no KV events",
                       code="kv_tiers_disabled")
    return events


def _resume_point(request: Request, since: int) -> int:
    header = request.headers.get("last-event-id")
    if header is None:
        return since
    if not header.strip().isdigit():
        raise bad_request(f"Last-Event-ID must be a non-negative integer (an event seq), "
                          f"got {header!r}", "Last-Event-ID")
    return int(header)


async def _stream(request: Request, ctx: ServerContext, log: EventLog,
                  since: int) -> AsyncIterator[str]:
    cursor = since if since <= log.last_seq else 0
    quiet_since = time.monotonic()
    while not ctx.engine.draining and not await request.is_disconnected():
        if log.last_seq <= cursor:
            if time.monotonic() - quiet_since >= KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield ": keep-alive\n\n"
            await asyncio.sleep(POLL_S)
            continue
        batch = log.since(cursor)
        lost = batch.dropped(cursor)
        out = [_sse(lost.last_seq, lost.to_json())] if lost else []
        out += [_sse(e.seq, e.to_json()) for e in batch.events]
        cursor = batch.events[-1].seq if batch.events else cursor
        quiet_since = time.monotonic()
        yield "".join(out)


def _sse(seq: int, payload: dict) -> str:
    return f"id: {seq}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
