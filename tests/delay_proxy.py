"""A loopback TCP proxy that adds a delay to every HTTP request passing through it: an S3
endpoint made slow on purpose, for the tier policy's cost model (tests and bench/tiers.py --slo).

The delay is applied once per request, when a chunk from the client starts with an HTTP method,
before it is forwarded; `delay_s` can be changed while the proxy runs. Threads only, no asyncio,
so it runs beside anything. Binds 127.0.0.1 on a free port and stops when closed."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

_METHODS = (b"GET ", b"PUT ", b"HEAD ", b"POST ", b"DELETE ")


class DelayProxy:
    def __init__(self, upstream_host: str, upstream_port: int, delay_s: float = 0.0):
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s
        self.requests = 0
        """HTTP requests delayed so far."""
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if requests and data.startswith(_METHODS):
                    self.requests += 1
                    if self.delay_s > 0:
                        time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


@contextlib.contextmanager
def delay_proxy(endpoint_url: str, delay_s: float = 0.0) -> Iterator[DelayProxy]:
    """A DelayProxy in front of http://host:port."""
    host, port = endpoint_url.removeprefix("http://").rstrip("/").split(":")
    proxy = DelayProxy(host, int(port), delay_s)
    try:
        yield proxy
    finally:
        proxy.close()
