"""Admitting a waiting request: the cache's answer (`PrefixCache.admit`) and what follows from it.

The scheduler asks when admission reaches a waiting request (and, ahead of that, as requests
arrive: `WaitingView.admit_ahead`). The cache decides whether the request may start now on what
is ready on the device, or must wait for a copy of its prefix from a lower tier (started by that
call when there is room for it); the scheduler learns only the answer and the device room a copy
took. A request that starts locks its prefix through the `Admission` (`lock`: the match, the lock,
and whatever state the match resumes from, with the positions its prompt pieces must end at);
`commit` counts its hits once it runs, `cancel` gives everything back when its memory did not fit.

What the cache remembers of one request between calls (the copies started for it, the span they
bring back) lives in the request's `AdmissionRecord`, which only the cache reads.

A leaf module (it imports nothing of the cache): prefix_cache.py and the stores name these types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence


class Verdict(enum.Enum):
    READY = "ready"  # it may start now with the part of its prefix ready on the device
    WAITS = "waits"  # a copy of more of its prefix is in flight: others go first meanwhile
    NO_ROOM = "no_room"  # a copy would help but finds no device room now: it may start without it


@dataclass
class AdmissionRecord:
    """What the cache keeps of one request across its waits (retractions included)."""

    loads: int = 0  # copies from the host tier started for it (a prefix evicted again is reloaded)
    # The prompt positions [span_start, span_end) it waited to have copied back (the widest such
    # span): at its first admission, the part of its locked prefix inside it counts as host hits
    # (a hybrid may resume before the span's end, at a snapshot).
    span_start: int = 0
    span_end: int = 0

    def note_span(self, start: int, end: int) -> None:
        if end - start > self.span_end - self.span_start:
            self.span_start, self.span_end = start, end


class Waiter(Protocol):
    """What the cache reads of a waiting request (scheduler.request.Req)."""

    rid: str
    cache_namespace: Optional[str]
    peek_len: int  # its cached length on any tier, as last looked up
    peek_node: Optional[Any]  # the tree node that lookup ended in (None: it is not waiting)
    branch_hints: tuple[int, ...]
    admission_record: AdmissionRecord

    def match_target(self) -> list[int]:
        ...


class Match(Protocol):
    """prefix_cache.MatchResult as an admission reads it."""

    length: int
    last_node: Any
    chunk_ends: tuple[int, ...]


class ResumedStates(Protocol):
    """What an admission asks of the states a cache keeps beyond KV (stores/snapshots.py)."""

    def resume(self, row: int, match: Any, *, branch_at: int = 0, hints: Sequence[int] = ()) -> tuple[int, ...]:
        """Put into state row `row` the state `match` ends at; the positions the request's prompt
        pieces must end at."""

    def cancel_resume(self, row: int) -> None:
        ...

    def resumed_from_host(self, row: int) -> bool:
        ...


class AdmittingCache(Protocol):
    """What an `Admission` needs of the cache that made it."""

    counters: Any  # prefix_cache.CacheCounters
    states: Optional[ResumedStates]  # None: it keeps no state beyond KV

    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> Match:
        ...

    def lock(self, node: Any) -> None:
        ...

    def unlock(self, node: Any) -> None:
        ...


class Admission:
    """The cache's answer for one waiting request, and its lock once it starts."""

    def __init__(self, cache: AdmittingCache, waiter: Waiter, verdict: Verdict = Verdict.READY,
                 loading: int = 0):
        self.cache = cache
        self.waiter = waiter
        self.verdict = verdict
        self.loading = loading  # device tokens a copy started by this call takes
        self.row: Optional[int] = None
        self.match: Optional[Match] = None
        self.chunk_ends: tuple[int, ...] = ()

    @property
    def waits(self) -> bool:
        return self.verdict is Verdict.WAITS

    @property
    def ready(self) -> bool:
        return self.verdict is Verdict.READY

    def lock(self, row: int, *, branch_at: int = 0) -> Match:
        """Take the request's cached prefix for state row `row`: the longest usable match ready on
        the device, held locked; the state it ends at beyond its KV (a hybrid's snapshot) goes into
        the row. branch_at: how far a waiting request shares its prompt (a cache keeping states
        keeps one there). Sets `chunk_ends`: the positions its prompt pieces must end at."""
        waiter, cache = self.waiter, self.cache
        match = cache.match(waiter.match_target(), namespace=waiter.cache_namespace)
        cache.lock(match.last_node)
        states = cache.states
        self.chunk_ends = match.chunk_ends if states is None else \
            states.resume(row, match, branch_at=branch_at, hints=waiter.branch_hints)
        self.row, self.match = row, match
        return match

    def cancel(self) -> None:
        """The request is not run after all (its memory did not fit): its resume counts as no hit,
        the row is given back with nothing kept and the prefix unlocked."""
        if self.cache.states is not None:
            self.cache.states.cancel_resume(self.row)
        self.cache.unlock(self.match.last_node)

    def commit(self, prompt_len: int) -> None:
        """The request runs, admitted for the first time: count its prompt and its hits (those
        served by the host tier: its whole cached prefix when its state came back from there, else
        the part inside the span it waited to have copied back)."""
        counters = self.cache.counters
        cached = min(self.match.length, prompt_len)
        counters.prompt_tokens += prompt_len
        counters.cached_prompt_tokens += cached
        states = self.cache.states
        record = self.waiter.admission_record
        from_host = cached if states is not None and states.resumed_from_host(self.row) \
            else max(0, min(cached, record.span_end) - record.span_start)
        counters.host_cached_prompt_tokens += from_host
