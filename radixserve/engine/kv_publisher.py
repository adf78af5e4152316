"""KV events in vLLM's wire format over ZMQ, published by the engine process (`--kv-events-config`).

The engine process publishes because only it has the token ids: the cache's events reach the API
process as block hashes (`/kv_events`), and sending every cached token over the IPC socket too
would cost the engine loop more than publishing them itself. Each loop iteration that cached or
dropped something sends one message on the PUB socket, three frames as vLLM's
`ZmqEventPublisher` sends them:

    topic (utf-8) | sequence number (8 bytes, big-endian, from 0) | msgpack payload

The payload is vLLM's `KVEventBatch`, an array `[ts, events, data_parallel_rank]` (ts: seconds
since the epoch; the rank: `--dp-rank`, 0 without data parallelism), its events
`BlockStored` / `BlockRemoved` / `AllBlocksCleared` as the cache's page events record them
(`radixserve.cache.page_events`, which `/kv_events` reads too), encoded in the config's `event_layout` (`radixserve.kv_events_config`). `lora_id` is
always nil (no adapters here).

A salted namespace's blocks (`cache_salt`, per-key caches) are published with an empty token id
list, as vLLM's BlockStored allows: their hashes, which chain from the namespace, are what a
gateway routes such requests by; `unsalted_token_ids` false empties the shared cache's too
(`radixserve.cache.page_events`).

Replay, vLLM's protocol: a client (DEALER, or REQ for the first reply only) sends
`b"" | start_seq` (8 bytes, big-endian) to the ROUTER at `replay_endpoint`; it gets back every
buffered batch from start_seq on as `b"" | seq | payload`, then `b"" | -1 (8 bytes, signed) | b""`.
The last `buffer_steps` batches are kept. Requests are served between engine steps (within the
loop's 50 ms idle poll when it has nothing to run).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Optional

import msgspec
import zmq

from radixserve.kv_events_config import KvEventsConfig, exposed_endpoints, offset_endpoint

if TYPE_CHECKING:  # the API process checks the addresses at start-up and imports no torch
    from radixserve.cache.prefix_cache import PublishedCache

logger = logging.getLogger("radixserve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
CLOSE_LINGER_MS = 1000  # what is still queued at shutdown gets this long to go out


def event_record(event: tuple, page_size: int, layout: str) -> list | dict:
    """One recorded block event as vLLM encodes it (tagged array or tagged map)."""
    kind = event[0]
    if kind == "BlockStored":
        _, hashes, parent, tokens, medium = event
        if layout == "array":
            return [kind, hashes, parent, tokens, page_size, None, medium]
        # Recent vLLM: required fields present even when nil, defaulted ones omitted.
        return {"type": kind, "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                "block_size": page_size, "lora_id": None, "medium": medium, "lora_name": None}
    if kind == "BlockRemoved":
        _, hashes, medium = event
        if layout == "array":
            return [kind, hashes, medium]
        return {"type": kind, "block_hashes": hashes, "medium": medium}
    return [kind] if layout == "array" else {"type": kind}


class ZmqKvEventPublisher:
    def __init__(self, config: KvEventsConfig, cache: "PublishedCache", dp_rank: int = 0):
        from radixserve.cache.page_events import page_events

        self.config = config
        self.dp_rank = dp_rank
        self.page_size = cache.page_size
        self.recorder = page_events(cache)
        self.recorder.follow_blocks(unsalted_token_ids=config.unsalted_token_ids)
        self.topic = config.topic.encode("utf-8")
        self.encoder = msgspec.msgpack.Encoder()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = 0
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.replay: Optional[zmq.Socket] = None
        try:
            self.pub.set_hwm(config.hwm)
            self.endpoint = offset_endpoint(config.resolved_endpoint, dp_rank)
            self.pub.setsockopt(zmq.IPV6, 1 if "[" in self.endpoint else 0)
            (self.pub.bind if config.endpoint_binds else self.pub.connect)(self.endpoint)
            self.replay_endpoint = offset_endpoint(config.replay_endpoint, dp_rank)
            if self.replay_endpoint is not None:
                self.replay = self.ctx.socket(zmq.ROUTER)
                # A replay answers up to buffer_steps messages at once: let them all queue.
                self.replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 2)
                self.replay.setsockopt(zmq.IPV6, 1 if "[" in self.replay_endpoint else 0)
                self.replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self.close(linger_ms=0)
            raise ValueError(f"--kv-events-config: cannot open {e.strerror.lower()} "
                             f"(endpoint {config.endpoint!r}, replay_endpoint {config.replay_endpoint!r}, "
                             f"data-parallel rank {dp_rank})") from None
        logger.info("KV events: publishing on %s (%s)%s, data-parallel rank %d, blocks of %d tokens; token ids "
                    "in %s", self.endpoint, "bound" if config.endpoint_binds else "connected",
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "", dp_rank, self.page_size,
                    "the shared cache's blocks only" if config.unsalted_token_ids else "no block")
        for endpoint in exposed_endpoints(config, dp_rank):
            logger.warning("KV events: %s listens on every interface, unauthenticated: whoever reaches it %s. "
                           "Bind 127.0.0.1, an ipc:// path or the one interface the router uses, and firewall it "
                           "(docs/serving.md, \"What a KV-event subscriber learns\")", endpoint,
                           ("reads the shared cache's prompts as token ids" if config.unsalted_token_ids
                            else "learns which prompts share prefixes")
                           + (", from the first one buffered (replay)" if endpoint == self.replay_endpoint else ""))

    def step(self) -> None:
        """Publish what the cache recorded since the last call as one batch; answer replay requests."""
        # A PUB socket takes in new subscribers' subscriptions only when it is used, and filters each
        # send by those it has taken in: without this, a subscriber that connected while the server
        # was idle would miss the next batch (it can replay it, but need not).
        self.pub.getsockopt(zmq.EVENTS)
        events = self.recorder.take_blocks()
        if events:
            layout = self.config.event_layout
            batch = [time.time(), [event_record(e, self.page_size, layout) for e in events], self.dp_rank]
            payload = self.encoder.encode(batch)
            self.pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
            self.buffer.append((self.seq, payload))
            self.seq += 1
        if self.replay is not None:
            self._serve_replay()

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                logger.warning("KV events: ignoring a replay request of %d frames (expected: empty, "
                               "an 8-byte start sequence number)", len(frames) - 1)
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= start_seq:
                    self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self, linger_ms: int = CLOSE_LINGER_MS) -> None:
        self.pub.close(linger_ms)
        if self.replay is not None:
            self.replay.close(0)
        self.ctx.term()


def check_kv_event_endpoints(settings) -> Optional[str]:
    """Why the addresses `--kv-events-config` binds cannot be bound now (None: they can), checked
    before anything loads by binding and closing them."""
    config = settings.kv_events
    if config is None:
        return None
    endpoints = [offset_endpoint(config.resolved_endpoint, settings.dp_rank)] if config.endpoint_binds else []
    if config.replay_endpoint:
        endpoints.append(offset_endpoint(config.replay_endpoint, settings.dp_rank))
    ctx = zmq.Context()
    try:
        for endpoint in endpoints:
            sock = ctx.socket(zmq.PUB)
            try:
                sock.setsockopt(zmq.IPV6, 1 if "[" in endpoint else 0)
                sock.bind(endpoint)
            except zmq.ZMQError as e:
                return f"--kv-events-config: cannot bind {endpoint}: {e.strerror}"
            finally:
                sock.close(0)
    finally:
        ctx.term()
    return None


def make_kv_publisher(settings, cache: "PublishedCache") -> Optional[ZmqKvEventPublisher]:
    """The publisher `--kv-events-config` asks for (None: off)."""
    config = settings.kv_events
    if config is None:
        return None
    return ZmqKvEventPublisher(config, cache, settings.dp_rank)
