"""How late an asyncio event loop runs its callbacks: a blocked loop delays every stream it serves.

`LoopLagWatch.run()` sleeps `interval_s` at a time and measures how much later than asked it woke
up. A wake-up over `threshold_s` late means something held the loop (a long synchronous call, a
garbage collection, a CPU-starved process); it is logged, and the count and worst lag are kept
for whoever reports on the process (the API server, the router, the benchmark client, whose own
stalls would otherwise read as the server's latency).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

logger = logging.getLogger(__name__)

LAG_THRESHOLD_S = 0.1


class LoopLagWatch:
    def __init__(self, process: str, *, threshold_s: float = LAG_THRESHOLD_S, interval_s: float = 0.02,
                 log: bool = True):
        self.process = process
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.log = log
        self.stalls = 0
        self.max_lag_s = 0.0

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.observe(time.perf_counter() - asked - self.interval_s)

    def observe(self, lag_s: float) -> None:
        self.max_lag_s = max(self.max_lag_s, lag_s)
        if lag_s >= self.threshold_s:
            self.stalls += 1
            if self.log:
                logger.warning("%s: event loop stalled for %.0f ms", self.process, lag_s * 1000)


@asynccontextmanager
async def watch_loop_lag(process: str, **kwargs) -> AsyncIterator[LoopLagWatch]:
    watch = LoopLagWatch(process, **kwargs)
    task = asyncio.create_task(watch.run(), name="loop-lag-watch")
    try:
        yield watch
    finally:
        task.cancel()
