"""Keep a worker's mirror tree in step with its radix cache, from the worker's `GET /kv_events`.

Each connection begins with a snapshot (so a late or reconnecting router is exact again), then
event batches with consecutive sequence numbers; a gap means events were lost, and the router
reconnects for a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional, Protocol

import httpx

from radixserve.router.metrics import RouterMetrics
from radixserve.router.workers import Worker

logger = logging.getLogger("radixserve.router")

RECONNECT_S = 1.0


class KvSyncOwner(Protocol):
    """What following a worker's events needs from the router (which implements it)."""

    client: Optional[httpx.AsyncClient]
    metrics: RouterMetrics

    @property
    def connect_timeout(self) -> float: ...


class SequenceGap(Exception):
    pass


def apply_events(worker: Worker, events: list) -> None:
    for seq, kind, hashes in events:
        if seq <= worker.kv_seq:
            continue
        if seq != worker.kv_seq + 1:
            raise SequenceGap(f"expected event {worker.kv_seq + 1}, got {seq}")
        worker.kv_seq = seq
        worker.kv_events += 1
        if kind == "insert":
            worker.mirror.add(hashes)
        elif kind == "evict":
            worker.mirror.discard(hashes)
        elif kind == "flush":
            worker.mirror.clear()


async def kv_sync_loop(router: KvSyncOwner, worker: Worker, headers: dict[str, str]) -> None:
    """headers: the router's admin headers for this worker (the router decides who gets the workers'
    admin key: trust.py)."""
    while True:
        try:
            if worker.healthy or not worker.ever_checked:
                await _follow(router, worker, headers)
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, SequenceGap, ValueError, KeyError) as e:
            logger.info("router: kv events of %s interrupted (%s); resynchronising", worker.id, e)
        worker.kv_synced = False
        await asyncio.sleep(RECONNECT_S)


async def _follow(router: KvSyncOwner, worker: Worker, headers: dict[str, str]) -> None:
    timeout = httpx.Timeout(None, connect=router.connect_timeout)
    async with router.client.stream("GET", worker.url + "/kv_events", headers=headers,
                                    timeout=timeout) as resp:
        if resp.status_code != 200:
            raise ValueError(f"/kv_events answered {resp.status_code}")
        event = None
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                if event == "snapshot":
                    worker.mirror.load(int(data["block_size"]), data["blocks"])
                    worker.kv_seq = int(data["seq"])
                    worker.kv_synced = True
                    router.metrics.kv_resyncs.labels(worker=worker.id).inc()
                elif event == "kv" and worker.kv_synced:
                    before = worker.kv_events
                    apply_events(worker, data["events"])
                    router.metrics.kv_events.labels(worker=worker.id).inc(worker.kv_events - before)
            elif not line:
                event = None
