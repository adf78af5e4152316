"""The engine process's heartbeat: a thread that tells the API process every HEARTBEAT_INTERVAL_S
that the process runs, how many steps its loop has finished and how long it has been in the loop
iteration it is in now (a step, when it has work).

The API process answers `/health` from these (`radixserve.server.liveness`), never by a round trip
through the engine loop: a busy engine whose steps take seconds stays green, while an engine whose
loop is wedged in one iteration (a collective that never returns, a kernel that never ends) or whose
process is stopped goes red. It is a thread because the loop itself says nothing while it is inside
a step; torch releases the interpreter lock in its kernels, so the thread beats during a long
forward pass too, and stops beating only when the whole process cannot run.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

import zmq

from radixserve.engine import messages as m

logger = logging.getLogger("radixserve")

HEARTBEAT_INTERVAL_S = 0.5
# Beats that the API process has not read yet are dropped beyond this many: only the newest matters.
HEARTBEAT_QUEUE = 4


class LoopPulse:
    """What the engine loop tells the heartbeat thread: the loop writes, the thread reads (single
    attribute stores and loads, atomic under the interpreter lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.iteration_started = clock()
        self.steps = 0
        self.busy = False

    def beat(self, *, busy: bool) -> None:
        """A loop iteration starts (busy: it has requests to step)."""
        self.iteration_started = self.clock()
        self.busy = busy

    def message(self) -> m.EngineHeartbeat:
        return m.EngineHeartbeat(pid=os.getpid(), steps=self.steps, busy=self.busy,
                                 loop_s=max(0.0, self.clock() - self.iteration_started))


class Heartbeat:
    """Sends `pulse.message()` to the API process's PULL socket at `out_addr` every `interval_s`,
    from its own thread and its own PUSH socket (ZMQ sockets are not shared between threads)."""

    def __init__(self, ctx: zmq.Context, out_addr: str, pulse: LoopPulse,
                 interval_s: float = HEARTBEAT_INTERVAL_S):
        self.ctx = ctx
        self.out_addr = out_addr
        self.pulse = pulse
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Heartbeat":
        self._thread = threading.Thread(target=self._run, name="engine-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, HEARTBEAT_QUEUE)
        sock.connect(self.out_addr)
        try:
            while True:
                try:
                    sock.send_multipart(m.encode(self.pulse.message()), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the API process is not reading: it has older beats waiting
                if self._stop.wait(self.interval_s):
                    return
        except Exception:  # noqa: BLE001: a heartbeat that stops makes /health red, which says enough
            logger.exception("engine heartbeat stopped")
        finally:
            sock.close(0)
