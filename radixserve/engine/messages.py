"""Messages between the API process and the engine process, beyond the request structs.

Every ZMQ message is a short kind name and one or more msgpack payloads of that kind, a frame
each: consecutive messages of one kind travel together (`batched`), so a burst of requests costs
one send. The request structs
(`GenerateRequest`, `AbortRequest`, `RequestOutput`) come from `radixserve.engine.io_struct`, so the
offline engine and the server validate the same way; the control messages live here.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from radixserve.engine.io_struct import AbortRequest, GenerateRequest, RequestOutput


# ----------------------------------------------------------------------------- API -> engine
class HealthProbe(msgspec.Struct, kw_only=True):
    """Generate one token for `rid`; exempt from the queue limit."""
    rid: str
    input_ids: list[int]


class FlushCache(msgspec.Struct, kw_only=True):
    reply_id: str


class GetStats(msgspec.Struct, kw_only=True):
    reply_id: str


class GetKvSnapshot(msgspec.Struct, kw_only=True):
    """Reply with the radix tree's token runs and the KV event sequence number they reflect, and
    start publishing insert/evict/flush events (routers mirror the tree from them)."""
    reply_id: str


class Shutdown(msgspec.Struct, kw_only=True):
    """Abort what is left and exit (sent after the API process has drained)."""


# ----------------------------------------------------------------------------- engine -> API
class EngineReady(msgspec.Struct, kw_only=True):
    pid: int
    model_path: str
    pool_size: int
    context_len: int
    vocab_size: int
    max_running_requests: int
    device: str
    dtype: str
    # Where the device's memory went (MemoryPlan.as_dict()); None on the CPU or with --max-total-tokens.
    memory: Optional[dict[str, Any]] = None
    # Whether prompts can be found in the prefix cache (off with --disable-radix-cache, and for a
    # hybrid model, whose recurrent states the cache does not keep yet).
    prefix_caching: bool = True


class EngineFailed(msgspec.Struct, kw_only=True):
    """The engine could not start (bad settings, no GPU, unreadable model)."""
    message: str


class RequestError(msgspec.Struct, kw_only=True):
    """A request the engine refused; `queue_full` means try again later (HTTP 503)."""
    rid: str
    message: str
    queue_full: bool = False


class EngineStats(msgspec.Struct, kw_only=True):
    """A snapshot of `EngineCore.stats()` plus the loop's own counters."""
    time: float
    values: dict[str, Any]


class OutputBatch(msgspec.Struct, kw_only=True):
    outputs: list[RequestOutput] = []
    errors: list[RequestError] = []
    stats: Optional[EngineStats] = None
    # Radix cache events of this step, each [seq, "insert" | "evict" | "flush", chained block hashes].
    kv_events: list[tuple[int, str, list[str]]] = []


class ControlReply(msgspec.Struct, kw_only=True):
    reply_id: str
    ok: bool
    message: str = ""
    data: Optional[dict[str, Any]] = None


ToEngine = Union[GenerateRequest, AbortRequest, HealthProbe, FlushCache, GetStats, GetKvSnapshot, Shutdown]
FromEngine = Union[EngineReady, EngineFailed, OutputBatch, ControlReply]

_TYPES: dict[bytes, type] = {
    cls.__name__.encode(): cls
    for cls in (GenerateRequest, AbortRequest, HealthProbe, FlushCache, GetStats, GetKvSnapshot, Shutdown,
                EngineReady, EngineFailed, OutputBatch, ControlReply)
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in _TYPES.items()}


def encode(msg: msgspec.Struct) -> list[bytes]:
    return [type(msg).__name__.encode(), _ENCODER.encode(msg)]


def batched(encoded: list[list[bytes]]) -> list[list[bytes]]:
    """`encode`d messages, in order, as ZMQ messages: each run of one kind as its kind frame
    followed by every payload of the run."""
    out: list[list[bytes]] = []
    for kind, payload in encoded:
        if out and out[-1][0] == kind:
            out[-1].append(payload)
        else:
            out.append([kind, payload])
    return out


def unbatched(frames: list[bytes]) -> list[list[bytes]]:
    """A received ZMQ message as one `decode`-able frame pair per payload (a message `decode`
    refuses stays whole)."""
    if len(frames) <= 2:
        return [frames]
    return [[frames[0], payload] for payload in frames[1:]]


def decode(frames: list[bytes]) -> Any:
    if len(frames) != 2 or frames[0] not in _DECODERS:
        raise ValueError(f"unknown message kind {frames[0]!r}" if frames else "empty message")
    return _DECODERS[frames[0]].decode(frames[1])
