"""A circuit breaker for a remote tier: stop calling an endpoint that keeps failing.

    closed    --threshold consecutive failures-->  open (for backoff_s)
    open      --backoff_s elapsed, allow()------>  half_open: exactly one caller gets True (probe)
    half_open --probe succeeds------------------>  closed (back-off reset)
    half_open --probe fails--------------------->  open again, back-off doubled up to max_backoff_s

While open (and while a probe is out), allow() is False at once: callers count a miss or drop the
write instead of waiting on timeouts. A success in the closed state resets the failure count.
Thread-safe; the clock is injectable so tests need not sleep.
"""

from __future__ import annotations

import threading
import time
from enum import Enum
from typing import Callable


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, threshold: int, backoff_s: float, max_backoff_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.threshold = threshold
        self.base_backoff_s = backoff_s
        self.max_backoff_s = max(backoff_s, max_backoff_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._backoff_s = backoff_s
        self._open_until = 0.0
        self.opened = 0
        """Times the breaker went from closed or half-open to open (a metrics counter)."""

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May the caller make a request now? In half-open, True for the one probe only."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._backoff_s = self.base_backoff_s

    def record_failure(self) -> None:
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
                self._open()
            elif self._state is BreakerState.CLOSED:
                self._failures += 1
                if self._failures >= self.threshold:
                    self._open()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._open_until = self._clock() + self._backoff_s
        self.opened += 1
