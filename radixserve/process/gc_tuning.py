"""Garbage-collector pauses: freeze what start-up built, keep full collections off the busy
path, and log every long collection.

A full collection walks every tracked object. In the API process each open stream holds ~200 of
them (coroutines, frames, cells, buffers); with 1,000 streams a full collection walked ~200k
objects and took 100-240 ms, freed nothing, and stalled every stream meanwhile; the engine process
(a big radix tree, many running requests) is alike. Objects made at start-up (model, tokenizer,
app) never become garbage: `freeze_startup_objects()` moves them out of the collector's sight.
`FullCollectionGovernor` keeps the other full collections off the busy path: they run when the
process is idle (or after `max_busy_s` without idling). Collections longer than `threshold_s`
are logged with their generation, so a latency tail can be matched to them.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Optional

logger = logging.getLogger("radixserve")

LONG_COLLECTION_S = 0.05
_watching: set[str] = set()
_scheduled_collection = False  # a governor's own full collection runs: logged by the governor


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()


def log_long_collections(process: str, threshold_s: float = LONG_COLLECTION_S) -> Optional[Callable]:
    """Once per process and name: log each collection that takes threshold_s or longer, except a
    governor's scheduled full collection (it logs its own line, at INFO: nobody waited for it).
    Returns the callback installed in gc.callbacks (None when already watching)."""
    if process in _watching:
        return None
    _watching.add(process)
    started = 0.0

    def on_collection(phase: str, info: dict) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
            return
        seconds = time.perf_counter() - started
        if seconds >= threshold_s and not _scheduled_collection:
            logger.warning("%s: garbage collection of generation %d took %.0f ms (%d objects freed)", process,
                           info.get("generation", -1), seconds * 1000, info.get("collected", 0))

    gc.callbacks.append(on_collection)
    return on_collection


class FullCollectionGovernor:
    """Turns automatic full collections off and makes them when the process is idle.

    Young objects are still collected as usual (generations 0 and 1, cheap: they walk only what
    was allocated since); only the walk over everything long-lived waits. Nothing is kept alive by
    this: objects die by reference counting as ever, only cycles that reached the oldest generation
    wait for `maybe_collect`, which collects fully when `idle` and `idle_interval_s` have passed
    since the last time, or, for a process that never idles, once `max_busy_s` have passed (one
    pause then, instead of one each time the heap grows by a quarter)."""

    NEVER = 2**31 - 1  # a generation-2 threshold no count of generation-1 collections reaches

    def __init__(self, process: str, idle_interval_s: float = 30.0, max_busy_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.process = process
        self.idle_interval_s = idle_interval_s
        self.max_busy_s = max_busy_s
        self.clock = clock
        self.last_complete = clock()
        self.complete_collections = 0
        self._saved_threshold: Optional[tuple[int, int, int]] = None

    def install(self) -> "FullCollectionGovernor":
        self._saved_threshold = gc.get_threshold()
        gc.set_threshold(self._saved_threshold[0], self._saved_threshold[1], self.NEVER)
        return self

    def uninstall(self) -> None:
        if self._saved_threshold is not None:
            gc.set_threshold(*self._saved_threshold)
            self._saved_threshold = None

    def maybe_collect(self, idle: bool) -> bool:
        """Call often (when there is nothing to do it reads a counter and the clock). True if it
        collected."""
        if gc.get_count()[2] == 0:  # no generation-1 collection since the last full one: nothing new is old
            return False
        waited = self.clock() - self.last_complete
        if waited < (self.idle_interval_s if idle else self.max_busy_s):
            return False
        global _scheduled_collection
        started = time.perf_counter()
        _scheduled_collection = True
        try:
            freed = gc.collect()
        finally:
            _scheduled_collection = False
        self.last_complete = self.clock()
        self.complete_collections += 1
        logger.info("%s: full garbage collection (%s) in %.0f ms, %d objects freed", self.process,
                    "idle" if idle else f"busy for {waited:.0f} s", (time.perf_counter() - started) * 1000, freed)
        return True

    async def run(self, is_idle: Callable[[], bool], interval_s: float = 1.0) -> None:
        """For an asyncio process: check every interval_s until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.maybe_collect(is_idle())


def govern_collections(process: str) -> FullCollectionGovernor:
    """What a server process calls once it is ready: start-up objects frozen, long collections
    logged, full collections governed. Call `maybe_collect` on the returned governor from the
    process's loop (or use `governed_collections` in an asyncio process)."""
    freeze_startup_objects()
    log_long_collections(process)
    return FullCollectionGovernor(process).install()


@asynccontextmanager
async def governed_collections(process: str, is_idle: Callable[[], bool]) -> AsyncIterator[FullCollectionGovernor]:
    """`govern_collections` for an asyncio process, checked every second while inside."""
    governor = govern_collections(process)
    task = asyncio.create_task(governor.run(is_idle), name="gc-governor")
    try:
        yield governor
    finally:
        task.cancel()
        governor.uninstall()
