"""The HTTP/1.1 connection: uvicorn's h11 protocol with two limits on a request's head.

    connection opens, or a response ends on a kept-alive connection
        -> the head must be whole within header_timeout_s, else 408 (or, if not one byte of it
           came, a quiet close, as an idle kept-alive connection gets)
    a head over max_header_bytes -> 431 with an OpenAI-style error body

The header deadline is set when the wait for a head begins and never moves: bytes that trickle
in (slowloris) do not push it back. uvicorn's own keep-alive timer, which any byte cancels,
still closes an idle connection sooner. Each refusal ends with a lingering close (see _linger)."""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from tierserve.server.errors import error_body


def limited_h11(header_timeout_s: float, max_header_bytes: int) -> type[LimitedH11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...), with these limits."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes})


class _HeadLimitedConnection(h11.Connection):
    """h11's server side, which also refuses a whole head over the limit, and keeps the error it
    last raised: uvicorn answers every RemoteProtocolError alike, so the protocol asks here which
    one it was. (h11 itself only limits a head still incomplete: one that arrived in a single
    read passes its max_incomplete_event_size whatever its size.)"""

    def __init__(self, max_header_bytes: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes
        self.error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and _head_bytes(event) > self.max_header_bytes:
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            return event
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


def _head_bytes(request: h11.Request) -> int:
    """The head's size on the wire: request line, each `name: value` line, the blank line."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(k) + len(v) + 4 for k, v in request.headers) + 2


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header deadline and size limit (see limited_h11)."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 << 10
    linger_s: float = 2.0
    """After a refusal, how long what the client still sends is read and dropped."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _HeadLimitedConnection(self.max_header_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._lingering = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._sync_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # once refused, what the client still sends is dropped
            super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next cycle (a kept-alive connection)
        self._sync_head_timer()

    def _sync_head_timer(self) -> None:
        """The timer runs exactly while h11 waits for a head (the client's state is IDLE only
        then): set when that wait begins, left alone while bytes of the head arrive."""
        waiting = (self.conn.their_state is h11.IDLE and not self._lingering
                   and not self.transport.is_closing())
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)
        elif not waiting and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not self.conn.trailing_data[0]:  # idle: no client is waiting for an answer
            self.transport.close()
            return
        self._refuse(408, f"the request head did not arrive within {self.header_timeout_s:g} s",
                     "request_timeout")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to any RemoteProtocolError: 431 for a head over the limit, else 400,
        both as JSON (the client's bytes are not echoed)."""
        if self.conn.error is not None and self.conn.error.error_status_hint == 431:
            self._refuse(431, f"the request line and headers exceed the limit of "
                         f"{self.max_header_bytes} bytes", "request_header_too_large")
        else:
            self._refuse(400, "invalid HTTP request", "invalid_http_request")

    def _refuse(self, status: int, message: str, code: str) -> None:
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        try:
            out = self.conn.send(h11.Response(status_code=status, headers=headers,
                                              reason=STATUS_PHRASES[status]))
            out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # h11 allows no answer in this state: close without one
            self.transport.close()
            return
        self.transport.write(out)
        self._linger()

    def _linger(self) -> None:
        """Close without losing the answer. Closing a socket with unread bytes (the rest of an
        oversized head, a slowloris's next byte) sends a TCP reset, and the client may drop the
        answer unread. So: send FIN after the answer, read and drop what still comes, and close
        when the client does, or after linger_s. TLS has no half-close: close at once."""
        self._lingering = True
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(self.linger_s, self.transport.close)
