"""Garbage-collector pauses: freeze what start-up built, and log every long collection.

A full collection walks every tracked object. In the engine process (a big radix tree, many
running requests) or the API process (thousands of open streams) one can take long enough to
stall every running request. Objects made at start-up (model, tokenizer, app) never become
garbage: `gc.freeze()` moves them out of the collector's sight. Collections longer than
`threshold_s` are logged with their generation, so a latency tail can be matched to them.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable, Optional

logger = logging.getLogger("radixserve")

LONG_COLLECTION_S = 0.05
_watching: set[str] = set()


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()


def log_long_collections(process: str, threshold_s: float = LONG_COLLECTION_S) -> Optional[Callable]:
    """Once per process and name: log each collection that takes threshold_s or longer.
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
        if seconds >= threshold_s:
            logger.warning("%s: garbage collection of generation %d took %.0f ms (%d objects freed)", process,
                           info.get("generation", -1), seconds * 1000, info.get("collected", 0))

    gc.callbacks.append(on_collection)
    return on_collection
