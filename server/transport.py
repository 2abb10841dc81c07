"""The HTTP/1.1 connection: uvicorn's h11 protocol with limits on a request's head and body.

    connection opens, or a response ends on a kept-alive connection
        -> the head must be whole within header_timeout_s, else 408 (or, if not one byte of it
           came, a quiet close, as an idle kept-alive connection gets)
    a head over max_header_bytes -> 431 with an OpenAI-style error body
    the head is whole, a body is due
        -> from header_timeout_s after the head on, the body must have come at min_body_rate
           bytes/s on average since the head, until its last byte; else 408

The header deadline is set when the wait for a head begins and never moves: bytes that trickle
in (slowloris) do not push it back. The body's rule is an average, so a trickle does not push it
back either, while a large body on a slow but honest link (above min_body_rate) is let through.
While the server itself stops reading (uvicorn's flow control: the app has not taken what came),
the client is not late: the average starts again. uvicorn's own keep-alive timer, which any byte
cancels, still closes an idle connection sooner. Each refusal ends with a lingering close (see
_linger)."""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from tierserve.server.errors import error_body


MIN_BODY_RATE = 1024
"""Bytes per second a request body must average once header_timeout_s has passed since its head
(a JSON body of a few KiB is whole long before; Kestrel's like rule asks for 240)."""


def limited_h11(header_timeout_s: float, max_header_bytes: int,
                min_body_rate: float = MIN_BODY_RATE) -> type[LimitedH11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...), with these limits."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes,
                 "min_body_rate": min_body_rate})


class _HeadLimitedConnection(h11.Connection):
    """h11's server side, which also refuses a whole head over the limit, and keeps the error it
    last raised: uvicorn answers every RemoteProtocolError alike, so the protocol asks here which
    one it was. (h11 itself only limits a head still incomplete: one that arrived in a single
    read passes its max_incomplete_event_size whatever its size.)"""

    def __init__(self, max_header_bytes: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes
        self.error: h11.RemoteProtocolError | None = None
        self.body_bytes = 0
        """Body bytes of the current request taken from the wire so far."""

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                if _head_bytes(event) > self.max_header_bytes:
                    raise h11.RemoteProtocolError("request head too large",
                                                  error_status_hint=431)
                self.body_bytes = 0
            elif isinstance(event, h11.Data):
                self.body_bytes += len(event.data)
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
    min_body_rate: float = MIN_BODY_RATE
    linger_s: float = 2.0
    """After a refusal, how long what the client still sends is read and dropped."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _HeadLimitedConnection(self.max_header_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_since: tuple[float, int] = (0.0, 0)
        """Where the body's average is measured from: (loop time, body bytes then)."""
        self._linger_timer: asyncio.TimerHandle | None = None
        self._lingering = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._sync_timers()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # once refused, what the client still sends is dropped
            super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_timers()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next cycle (a kept-alive connection)
        self._sync_timers()

    def _sync_timers(self) -> None:
        self._sync_head_timer()
        self._sync_body_timer()

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

    def _sync_body_timer(self) -> None:
        """The body's check runs exactly while h11 expects body bytes (SEND_BODY): its first
        look is header_timeout_s after the head."""
        receiving = (self.conn.their_state is h11.SEND_BODY and not self._lingering
                     and not self.transport.is_closing())
        if receiving and self._body_timer is None:
            self._body_since = (self.loop.time(), 0)  # bytes that came with the head count
            self._body_timer = self.loop.call_later(self.header_timeout_s, self._check_body)
        elif not receiving and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _check_body(self) -> None:
        """Still short of the body: 408 if its average since the head is under min_body_rate,
        else look again when, without another byte, it would be."""
        self._body_timer = None
        if self.transport.is_closing():
            return
        now, (since, base) = self.loop.time(), self._body_since
        waiting = self.cycle is not None and self.cycle.waiting_for_100_continue
        if self.flow.read_paused or waiting:  # the server is not reading: measure from now
            self._body_since = (now, self.conn.body_bytes)
            self._body_timer = self.loop.call_later(self.header_timeout_s, self._check_body)
            return
        received = self.conn.body_bytes - base
        due = since + received / self.min_body_rate
        if due > now:
            self._body_timer = self.loop.call_later(max(due - now, 0.1), self._check_body)
            return
        self._refuse(408, f"the request body came slower than {self.min_body_rate:g} bytes/s "
                     f"({received} bytes in {now - since:.1f} s after the head)",
                     "request_timeout")
        if self.cycle is not None and not self.cycle.response_complete:
            # the app waits on the body: it learns the client is gone, and answers no one
            self.cycle.disconnected = True
            self.cycle.message_event.set()

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
