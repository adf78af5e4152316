"""What one scheduling step hands the model runner, and the launched step whose tokens are still
on the device.

Overlap scheduling: the engine builds and launches step N+1 before it reads step N's sampled
tokens. `StepInFlight` is step N during that time; it is the one place that says which tokens the
host has not seen. The scheduler works on positions meanwhile (`Req.pending` counts each such
token in `Req.seq_len`), takes every decision that needs token values (stop tokens, stop strings)
when the step is collected, and collects it early itself when it would otherwise have to retract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from radixserve.scheduler.request import Req


@dataclass
class ScheduledBatch:
    reqs: list[Req] = field(default_factory=list)
    kv_lens_before: list[int] = field(default_factory=list)  # positions whose KV exists before this step
    extend_lens: list[int] = field(default_factory=list)  # new positions computed in this step
    sample: list[bool] = field(default_factory=list)  # whether the request samples a token after this step
    num_new_seqs: int = 0
    num_new_tokens: int = 0  # prompt tokens computed for admitted / chunked requests
    num_cached_tokens: int = 0  # prompt tokens of new admissions found in the cache
    # In-batch sharing keys of the uncached prefixes this step computes (see PrefillAdder).
    shared_prefix_keys: set[tuple] = field(default_factory=set)
    # The requests this step admitted from the queue (they wait again if the step is taken back).
    admitted: list[Req] = field(default_factory=list)
    # (batch row, offset into its piece, snapshot slot): a hybrid model's recurrent state after that
    # many of the row's new tokens goes into that snapshot slot (RequestStates.capture_states).
    state_captures: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        # list.count runs in C: every stage of a step asks this of a batch of up to ~1,000 requests.
        return self.num_new_tokens == 0 and self.extend_lens.count(1) == len(self.extend_lens)

    def add(self, req: Req, kv_len_before: int, extend: int, sample: bool) -> None:
        self.reqs.append(req)
        self.kv_lens_before.append(kv_len_before)
        self.extend_lens.append(extend)
        self.sample.append(sample)

    def add_decode(self, reqs: list[Req], kv_lens_before: list[int]) -> None:
        """One new position for each request, each sampling a token: the decode part of a step,
        added in one go (it is most of a step's requests)."""
        self.reqs.extend(reqs)
        self.kv_lens_before.extend(kv_lens_before)
        self.extend_lens.extend([1] * len(reqs))
        self.sample.extend([True] * len(reqs))


class TokenFuture(Protocol):
    """The ids a launched step samples, one per sampling request in batch order."""

    wait_s: float  # how long result() waited for the device (0 before it is called)

    def result(self) -> list[int]:
        """Wait until they are on the host and return them."""

    def logprobs(self) -> Optional[list]:
        """After result(): per sampled id its `TokenLogprob` (None where not asked for), or None
        when no request of the step asked."""

    def prompt_logprobs(self) -> Optional[list]:
        """After result(): per request of the batch the prompt `TokenLogprob`s the step gathered
        for it, or None when it gathered none."""


@dataclass
class StepInFlight:
    """A launched step whose sampled tokens the host has not processed yet."""

    batch: ScheduledBatch
    tokens: TokenFuture
    # The requests with news for the caller, once the scheduler has collected the step.
    updated: Optional[list[Req]] = None

    @property
    def collected(self) -> bool:
        return self.updated is not None

    @property
    def shared_prefix_keys(self) -> set[tuple]:
        """Prefixes this step is computing: not in the tree until it is collected."""
        return set() if self.collected else self.batch.shared_prefix_keys
