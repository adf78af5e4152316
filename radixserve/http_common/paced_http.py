"""uvicorn's HTTP/1.1 protocol, paced: a burst of requests is taken in over many short event-loop
iterations instead of one long one (the API server and the router use it); and bounded: a request
that is not sent in time is cut off, and connections beyond the cap are refused as they open
(`PacedHttpProtocol`).

The event loop hands every connection whose bytes arrived to its protocol in one iteration, before
any ASGI middleware runs: a burst of 1,024 requests on open connections was parsed in one 45 ms
stretch on a 2-core machine (a py-spy profile), and the requests' handlers then began together,
stalling every stream and timer for 140-150 ms.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections import deque
from typing import Callable, Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Connections whose request bytes are parsed in one event-loop iteration (each request then begins:
# parse, validate, submit, ~1-2 ms on a busy 2-core machine); the rest wait for the next ones, so a
# burst is taken in over many short iterations instead of one long one that holds up every stream.
INTAKE_PER_ITERATION = 16
# A request's headers must arrive within this many seconds of its first byte (a fresh connection:
# of its opening); its body within BODY_TIMEOUT_S of the headers (a 2 MB body at 35 KB/s).
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0


class IterationGate:
    """`call(fn)` runs fn in an event-loop iteration that has run fewer than `per_iteration` of
    them, first come first served. The event loop runs every callback that is ready when an
    iteration starts, so without it 1,000 requests arriving together are all taken in by one
    iteration that holds up every stream and timer."""

    def __init__(self, per_iteration: int):
        self.per_iteration = per_iteration
        self.admitted = 0  # run in the current iteration
        self.waiting: deque[Callable[[], None]] = deque()
        self.tick_scheduled = False

    def call(self, fn: Callable[[], None]) -> None:
        if not self.waiting and self.admitted < self.per_iteration:
            self.admitted += 1
            self._schedule_tick()
            fn()
            return
        self.waiting.append(fn)
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        if not self.tick_scheduled:
            self.tick_scheduled = True
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        """Once per iteration while requests come in: the next iteration's allowance, the waiting
        first (a callback scheduled now runs in the next iteration)."""
        self.tick_scheduled = False
        self.admitted = 0
        try:
            while self.waiting and self.admitted < self.per_iteration:
                self.admitted += 1
                self.waiting.popleft()()
        finally:
            if self.waiting or self.admitted:
                self._schedule_tick()


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style error body, for answers written before (or
    instead of) the app: the connection closes after it."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "service_unavailable_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode("ascii") + body


class PacedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, parsing the bytes of at most `INTAKE_PER_ITERATION`
    connections per event-loop iteration (one gate per event loop); a connection's later bytes
    queue behind its earlier ones.

    It also bounds what a slow or idle client holds (uvicorn bounds only the idle time between
    requests, `timeout_keep_alive`): a request's headers must be complete within
    HEADER_TIMEOUT_S of its first byte (or of the connection opening), else 408 and the connection
    closes; its body within BODY_TIMEOUT_S of the headers, else the connection closes (the app sees
    a disconnect). And a connection beyond uvicorn's `limit_concurrency` is answered 503 and closed
    as soon as it opens, so slow connections cannot use up the process's file descriptors: 1,010
    half-sent requests under `ulimit -n 1024` made every new client fail."""

    _gates: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, IterationGate]" = weakref.WeakKeyDictionary()
    _read_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            transport.write(_raw_error(503, "Service Unavailable", f"the server holds its most connections "
                                       f"({self.limit_concurrency}, --max-connections); retry later",
                                       "too_many_connections"))
            transport.close()
            return
        self._arm(HEADER_TIMEOUT_S, self._headers_too_slow)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        gate = self._gates.get(self.loop)
        if gate is None:
            gate = self._gates[self.loop] = IterationGate(INTAKE_PER_ITERATION)
        gate.call(lambda: self._parse(data))

    def _parse(self, data: bytes) -> None:
        if self.parser is not None:  # the connection is still there
            super().data_received(data)

    # Parser callbacks, in the order a request's bytes make them.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(HEADER_TIMEOUT_S, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        self._arm(BODY_TIMEOUT_S, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _headers_too_slow(self) -> None:
        self._read_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_raw_error(408, "Request Timeout", f"the request's headers did not arrive within "
                                            f"{HEADER_TIMEOUT_S:g} s", "request_timeout"))
            self.transport.close()

    def _body_too_slow(self) -> None:
        self._read_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.logger.info("closing a connection whose request body did not arrive within %g s", BODY_TIMEOUT_S)
            self.transport.close()
