"""A pytest plugin: the CPU copy engine made as late as a GPU's copy stream may be.

On the CPU the host tier's copies run at issue (`host_pool.SyncCopyEngine`), so no test sees what
a card allows: a copy between the tiers that runs long after it was issued, while the engine goes
on. With this plugin (`PYTHONPATH=tests pytest -p late_copies ...`) each copy runs in issue order
only once it has been polled LATE_COPY_POLLS times (default 3), or when something waits for it:
what a copy stream busy with earlier copies does. A write-back still gathers the device rows at
issue, as the GPU's does on the compute stream.

The suite does not load it: it is a probe for ordering bugs between the tiers, run by hand. On
2026-12-06 it made the host tier's tests of a hybrid model hit "decode memory is ensured before it
is taken" (a lone request that found no page after eviction), with the storage tier and without,
and, with a host tier alone, give other tokens than the untiered engine for one prompt of ten
(`LATE_COPY_POLLS=2`); both are open. The case: `build_tiny_model(..., family="qwen3_5",
hidden=256, intermediate=1024, num_heads=4, num_kv_heads=2, seed=4, layers=4, head_dim=32)`, the
ten prompts `test_storage_tier.long_prompts(10, seed=8, lengths=(80, 150))`, 24 greedy tokens
each, served twice by `Engine(path, device="cpu", dtype="float32", max_total_tokens=256,
page_size=16, hicache_ratio=1, chunked_prefill_size=32)` against the same engine with a pool of
4,096 tokens and no host tier: the second pass gives prompt 4 other tokens.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

import radixserve.cache.factory as factory
import radixserve.cache.host_pool as host_pool

POLLS = int(os.environ.get("LATE_COPY_POLLS", "3"))


class _Copy:
    """A copy not yet run: it runs once (at the latest when it is waited for)."""

    def __init__(self, run: Callable[[], None]):
        self.run, self.done, self.polls = run, False, 0

    def finish(self) -> None:
        if not self.done:
            self.run()
            self.done = True


class LateCopyEngine(host_pool.SyncCopyEngine):
    def __init__(self, device_pool, host):
        super().__init__(device_pool, host)
        self.queue: list[_Copy] = []

    def _queue(self, run: Callable[[], None]) -> tuple[_Copy, _Copy]:
        copy = _Copy(run)
        self.queue.append(copy)
        return copy, copy

    def _run_through(self, copy: _Copy) -> None:
        """Run the queued copies up to copy, in issue order (a stream)."""
        while self.queue:
            first = self.queue.pop(0)
            first.finish()
            if first is copy:
                return

    def _write_back(self, dev_slots: torch.Tensor, host_slots: torch.Tensor):
        rows = [(k[dev_slots].clone(), v[dev_slots].clone()) for k, v in zip(self.dev_k, self.dev_v)]
        host_slots = host_slots.clone()

        def run() -> None:
            for layer, (k, v) in enumerate(rows):
                self.host_buf[host_slots, layer, 0] = k
                self.host_buf[host_slots, layer, 1] = v
        return self._queue(run)

    def _load(self, host_slots: torch.Tensor, dev_slots: torch.Tensor):
        host_slots, dev_slots = host_slots.clone(), dev_slots.clone()

        def run() -> None:
            rows = self.host_buf[host_slots]
            for layer, (k, v) in enumerate(zip(self.dev_k, self.dev_v)):
                k[dev_slots] = rows[:, layer, 0]
                v[dev_slots] = rows[:, layer, 1]
        return self._queue(run)

    def _issue(self, copy: Callable[[], None], uses):
        return self._queue(copy)

    def _is_done(self, event: _Copy) -> bool:
        event.polls += 1
        if event.polls >= POLLS:
            self._run_through(event)
        return event.done

    def _synchronize(self, event: _Copy) -> None:
        self._run_through(event)

    def _stream_waits(self, event: _Copy) -> None:
        self._run_through(event)

    def _drain(self) -> None:
        if self.queue:
            self._run_through(self.queue[-1])

    def _elapsed(self, start, end) -> float:
        return 1e-3


def _make_copy_engine(device_pool, host):
    if device_pool.k_buffers[0].device.type == "cuda":
        return host_pool.CudaCopyEngine(device_pool, host)
    return LateCopyEngine(device_pool, host)


host_pool.make_copy_engine = _make_copy_engine
factory.make_copy_engine = _make_copy_engine
