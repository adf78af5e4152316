"""Typed messages between the API process and the engine process (msgspec, sent over ZMQ).

The offline `Engine` uses the same structs, so both paths validate requests identically.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import msgspec

from radixserve.sampling_params import SamplingParams, TokenLogprob


class GenerateRequest(msgspec.Struct, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    log: bool = False  # log arrival/finish of this request (--log-requests)
    # False: the caller wants the whole result only; the engine sends the first token (for the
    # time to first token) and the end, not every step's token.
    stream: bool = True


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
    # {"type": "stop"|"length"|"abort", "matched": token id or stop string, "message": ...}
    finish_reason: Optional[dict] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Seconds since arrival when the first token was produced (set on the first output only).
    ttft: Optional[float] = None
    queue_time: Optional[float] = None


EngineMessage = Union[GenerateRequest, AbortRequest]
