"""`GET /kv_events`: the radix cache's insert/evict/flush events as a server-sent event stream.

A router mirrors what each worker's cache really holds from this stream. It carries chained
hashes of whole blocks (`radixserve.cache.page_events`: a block is the fewest whole pages that
reach KV_HASH_BLOCK_TOKENS tokens, hashed by the chain the vLLM-format events' pages use, with the
block as its unit), never token ids. Every connection
starts with a snapshot of the whole tree (so a router that connects late, or reconnects after
missing events, is exact again), then carries event batches in engine order:

    event: snapshot
    data: {"seq": S, "block_size": B, "page_size": P, "blocks": [hash, ...]}

    event: kv
    data: {"events": [[seq, "insert" | "evict" | "flush", [hash, ...]], ...]}

Event `seq` numbers count up by one from the snapshot's `seq` (events at or below it are already
in the snapshot and are not sent). "insert" carries the hashes of the inserted path's blocks,
"evict" those of the blocks the tree no longer holds, "flush" nothing (the tree is empty). A
subscriber that falls too far behind is disconnected and must reconnect (and so resynchronise).
The engine only starts recording events once the first subscriber asked for a snapshot, and
batches them per step. The stream shows what every user's prompts share, so it is an admin
endpoint (`--admin-api-key`, else `--api-key`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from radixserve.server.engine_client import EngineClient, EngineDeadError
from radixserve.server.errors import error_response

logger = logging.getLogger("radixserve")

SUBSCRIBER_QUEUE_BATCHES = 4096
KEEPALIVE_S = 5.0
_CLOSED = object()


class KvEventHub:
    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.subscribers: set[asyncio.Queue] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        engine.on_kv_events = self.publish

    def publish(self, events: list) -> None:
        for queue in list(self.subscribers):
            try:
                queue.put_nowait(events)
            except asyncio.QueueFull:  # too slow: cut it off, it resynchronises on reconnect
                self.subscribers.discard(queue)
                queue.get_nowait()
                queue.put_nowait(_CLOSED)

    def close_all(self) -> None:
        """End every subscriber's stream (on shutdown: an endless stream would hold up the drain)."""
        for queue in list(self.subscribers):
            self.subscribers.discard(queue)
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(_CLOSED)

    async def stream(self) -> AsyncIterator[str]:
        self.loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_QUEUE_BATCHES)
        # Subscribe before asking for the snapshot, so nothing falls between the two.
        self.subscribers.add(queue)
        try:
            snapshot = await self.engine.kv_snapshot()
            seq = int(snapshot.get("seq", 0))
            yield f"event: snapshot\ndata: {json.dumps(snapshot, separators=(',', ':'))}\n\n"
            while self.engine.alive:
                try:
                    batch = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if batch is _CLOSED:
                    return
                fresh = [e for e in batch if e[0] > seq]
                if fresh:
                    seq = fresh[-1][0]
                    yield f"event: kv\ndata: {json.dumps({'events': fresh}, separators=(',', ':'))}\n\n"
        finally:
            self.subscribers.discard(queue)


def install_kv_events(app: FastAPI, engine: EngineClient) -> KvEventHub:
    hub = KvEventHub(engine)

    @app.get("/kv_events")
    async def kv_events():
        if not engine.alive:
            return error_response(503, f"the engine is unavailable: {engine.dead_reason or 'not started'}",
                                  code="engine_unavailable")
        try:
            first = await _first(hub.stream())
        except (EngineDeadError, asyncio.TimeoutError) as e:
            return error_response(503, f"the engine gave no cache snapshot: {e}", code="engine_unavailable")
        return StreamingResponse(first, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return hub


async def _first(gen: AsyncIterator[str]) -> AsyncIterator[str]:
    """Run `gen` up to its first chunk now (so errors become a status code), then stream the rest."""
    head = await gen.__anext__()

    async def chained() -> AsyncIterator[str]:
        try:
            yield head
            async for chunk in gen:
                yield chunk
        finally:
            await gen.aclose()

    return chained()
