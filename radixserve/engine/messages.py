"""Every message between the API process and the engine process (msgspec structs over ZMQ).

Every ZMQ message is a short kind name and one or more msgpack payloads of that kind, a frame
each: consecutive messages of one kind travel together (`batched`), so a burst of requests costs
one send. The request structs (`GenerateRequest`, `AbortRequest`, `RequestOutput`) are also what
the offline `Engine` takes and returns, so both paths validate requests identically. Nothing here
imports torch: the API process imports this module.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import msgspec

from radixserve.sampling_params import FinishReason, SamplingParams, TokenLogprob


# ----------------------------------------------------------------------------- requests and their outputs
class GenerateRequest(msgspec.Struct, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    log: bool = False  # log arrival/finish of this request (--log-requests)
    # False: the caller wants the whole result only; the engine sends the first token (for the
    # time to first token) and the end, not every step's token.
    stream: bool = True
    # The request's cache namespace (`radixserve.cache.namespace.cache_namespace` of its cache_salt
    # and API key): it shares cached prefixes only with requests of the same one. None: the shared one.
    cache_namespace: Optional[str] = None
    # Prompt positions where later requests are likely to branch off this one (the end of a chat's
    # system turn, found by the API for a hybrid model; `Req.branch_hints`).
    branch_hints: tuple[int, ...] = ()


class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str


class RequestOutput(msgspec.Struct, kw_only=True, gc=False):
    """What one engine step produced for one request: new tokens, and the end when it came.

    Untracked by the garbage collector (gc=False): an engine step makes one per running request
    (a thousand and more at high concurrency), and tracked, each made the collector's young
    collections walk it, in both processes; an output holds only lists, numbers and a dict of
    them, so it is never part of a reference cycle."""

    rid: str
    new_token_ids: list[int]
    # One per new token when the request asked for log probabilities, else empty. The engine
    # leaves an empty one as the shared () rather than a new list per output; decoded, it is a list.
    new_logprobs: Sequence[TokenLogprob] = ()
    # Prompt log probabilities (sampling_params.logprob_start_len), all of them, with the first
    # token only: of prompt tokens max(logprob_start_len, 1) onwards.
    input_logprobs: Sequence[TokenLogprob] = ()
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Seconds since arrival when the first token was produced (set on the first output only).
    ttft: Optional[float] = None
    queue_time: Optional[float] = None


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
    # Whether the prefix cache keeps states where requests branch (a hybrid model's): then the API
    # tells it where they are likely to (`GenerateRequest.branch_hints`).
    keeps_branch_states: bool = False


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


class EngineHeartbeat(msgspec.Struct, kw_only=True):
    """Sent by the engine process's heartbeat thread every half second (radixserve.engine.heartbeat),
    whatever its loop is doing: /health is answered from the latest one."""
    pid: int
    steps: int  # steps the loop has finished
    busy: bool  # whether the loop had requests to step when its current iteration started
    loop_s: float  # seconds the loop has been in its current iteration (a step, when busy)


class ControlReply(msgspec.Struct, kw_only=True):
    reply_id: str
    ok: bool
    message: str = ""
    data: Optional[dict[str, Any]] = None


ToEngine = Union[GenerateRequest, AbortRequest, HealthProbe, FlushCache, GetStats, GetKvSnapshot, Shutdown]
FromEngine = Union[EngineReady, EngineFailed, OutputBatch, EngineHeartbeat, ControlReply]

_TYPES: dict[bytes, type] = {
    cls.__name__.encode(): cls
    for cls in (GenerateRequest, AbortRequest, HealthProbe, FlushCache, GetStats, GetKvSnapshot, Shutdown,
                EngineReady, EngineFailed, OutputBatch, EngineHeartbeat, ControlReply)
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
