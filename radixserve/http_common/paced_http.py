"""uvicorn's HTTP/1.1 protocol, paced: a burst of requests is taken in over many short event-loop
iterations instead of one long one (the API server and the router use it).

The event loop hands every connection whose bytes arrived to its protocol in one iteration, before
any ASGI middleware runs: a burst of 1,024 requests on open connections was parsed in one 45 ms
stretch on a 2-core machine (a py-spy profile), and the requests' handlers then began together,
stalling every stream and timer for 140-150 ms.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Connections whose request bytes are parsed in one event-loop iteration (each request then begins:
# parse, validate, submit, ~1-2 ms on a busy 2-core machine); the rest wait for the next ones, so a
# burst is taken in over many short iterations instead of one long one that holds up every stream.
INTAKE_PER_ITERATION = 16


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


class PacedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, parsing the bytes of at most `INTAKE_PER_ITERATION`
    connections per event-loop iteration (one gate per event loop); a connection's later bytes
    queue behind its earlier ones."""

    _gates: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, IterationGate]" = weakref.WeakKeyDictionary()

    def data_received(self, data: bytes) -> None:
        gate = self._gates.get(self.loop)
        if gate is None:
            gate = self._gates[self.loop] = IterationGate(INTAKE_PER_ITERATION)
        gate.call(lambda: self._parse(data))

    def _parse(self, data: bytes) -> None:
        if self.parser is not None:  # the connection is still there
            super().data_received(data)
