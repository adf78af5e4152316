"""The prefix cache as the scheduler, the engine and the event publishers see it: one protocol,
the tree node it hands out as a handle, and the result and counter types they share.

Two implementations:

- `RadixCache` (radix_cache.py): the radix tree (tree.py) and the stores beside it (stores/): the
  device KV always; a host tier under it (a prefix evicted from the device is copied to the host
  and loaded back); a hybrid model's recurrent-state snapshots (state_snapshots.py), on the
  device and with a host tier on the host too. `factory.tree_cache` picks the stores.
- `NoPrefixCache` (no_cache.py): `--disable-radix-cache`. Nothing is kept or found; a request
  computes its whole prompt and frees its KV when it leaves.

`PrefixCache` is small: a running request's prefix is `match`ed, held with `lock` / `unlock`,
given back with `insert` and freed on demand with `evict`; a waiting one is `admit`ted. What only
one part of the scheduler asks for sits in a part of its own, each an attribute:

- `waiting` (`WaitingView`, waiting_view.py): the waiting queue's side. Where a waiting request
  parks and how much of its prompt is cached on any tier (`peek_park`), which paths waiting
  requests will reuse (`add_waiter` / `remove_waiter`: queue-aware eviction), the copies from a
  lower tier started as requests arrive (`admit_ahead`) and taken in at each step (`poll`), and
  which parked lookups the tree's changes affect (`drain_touched`).
- `memory` (`CacheMemory`): the device tokens the cache holds, split by who may free them, and
  the check that they add up with the free list and the running requests.
- `conversations` (`Conversations`, conversations.py): where finished requests' prompts ended,
  and whether an admitted request's match continues one of them.
- `states` (`RequestStates`): a request's state beyond its KV (a hybrid model's recurrent state);
  None for a cache of KV alone.

How a request uses it (scheduler/kv_manager.py and waiting_queue.py): while it waits,
`waiting.peek_park` says how much of its prompt is cached and where to park it, `add_waiter` marks
that path as wanted and `admit_ahead` starts the copies of lower-tier parts it will wait for.
When admission reaches it, `admit` says whether it starts now or waits for such a copy; the
`Admission` it returns (cache/admission.py) locks the device part ready to read (`match`, `lock`)
and puts into the request's state row whatever else the match needs. What it computes goes back
with `insert` (as much as `insertable_len` says the cache takes) and, where the cache keeps states,
`states.keep_states`; `unlock` lets go.

Every lookup and insert names the request's cache namespace (`cache/namespace.py`: its
`cache_salt`, and its API key with `--cache-salt-per-api-key`; None: the shared one). Prefixes
of different namespaces are never shared: the tree keeps each namespace under its own child of the
root, so everything else works in it as in the shared one.

What a cache holds is per position: a match is usable only up to the deepest position every
kind of state it keeps is there for, and `peek_park`/`match` report that usable length. For a model of
attention layers alone the one kind is per-token KV (on the device or the host). A hybrid model's
recurrent-state snapshots (one fixed-size state that can only be resumed where it was taken) are
a third kind: the snapshot store keeps them at node boundaries, its matches stop at the deepest
boundary holding both KV and a snapshot, and it tells the scheduler where a request's prompt
pieces must end (`MatchResult.chunk_ends`: a branch point, where the state is taken with
`take_state`). A cache of KV alone asks for no chunk end and keeps no state, so the same scheduler
code runs over every implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, runtime_checkable

import torch

from radixserve.cache.tree import ALL, PageEventListener, TreeNode

# The tree's node is the handle the scheduler holds, and ALL the park key of a removed node.
__all__ = ["ALL", "CacheCounters", "CacheMemory", "MatchResult", "OwnedPrefixCache", "PrefixCache", "PublishedCache",
           "RequestStates", "TreeNode", "check_slot_ownership", "no_host_tier_stats", "no_snapshot_stats"]

if TYPE_CHECKING:
    from radixserve.cache.admission import Admission, Waiter
    from radixserve.cache.conversations import Conversations
    from radixserve.cache.host_pool import CopyEngine
    from radixserve.cache.kv_pool import PageAllocator
    from radixserve.cache.waiting_view import WaitingView


@dataclass
class MatchResult:
    length: int
    slots: torch.Tensor  # int64, the cached KV slots of tokens[:length]
    last_node: TreeNode  # the node the match ends in (exactly at its end)
    # Positions past `length` where the request's prompt pieces must end, so that the state there
    # can be kept (`RequestStates.take_state`): a hybrid model's branch point. () for a cache of KV alone.
    chunk_ends: tuple[int, ...] = ()
    # The length of the tokens looked up (a request's match target): how far its prompt runs.
    target_len: int = 0


@dataclass
class CacheCounters:
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_prompt_tokens: int = 0  # of which were found in the cache
    host_cached_prompt_tokens: int = 0  # of those, served by the host tier (KV or the resumed state copied back)
    inserted_tokens: int = 0  # tokens newly added to the tree
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_rate(self) -> float:
        return self.hit_rate - self.host_hit_rate


class RequestStates(Protocol):
    """A request's state beyond its KV that the cache keeps at chosen positions (a hybrid model's
    recurrent state, stores/snapshots.py; its rows: stores/snapshot_rows.py), as the scheduler and
    the model runner drive it: the request runs in a state row; its prompt pieces end where the
    cache keeps a state (`Admission.chunk_ends`)."""

    def take_state(self, row: int, position: int) -> None:
        """The step being scheduled takes row's request to `position`, one of its chunk ends: keep
        the state there once that step is launched."""

    def capture_states(self, row: int, start: int, end: int) -> list[tuple[int, int]]:
        """The step being scheduled computes positions [start, end) of row's request: the states it
        keeps on the way, as (position, snapshot slot) with start < position < end, which the forward
        pass writes into those slots as it passes them (`ScheduledBatch.state_captures`); the state
        at `end` itself, where it keeps one, is copied from the row once the step is launched
        (take_state)."""

    def keep_states(self, row: int, tokens: Sequence[int], *, namespace: Optional[str] = None,
                    state_len: Optional[int] = None, readmitted: bool = False) -> None:
        """After `insert(tokens, ...)` by the request in state row `row`: hang the states taken of it
        (`take_state`) within tokens on the tree. state_len: the request leaves and its row holds
        the state after state_len positions (kept where tokens end there); the row is given back.
        readmitted: the request waits to be admitted again (retracted, or its step taken back), so
        that state is sure to be resumed from."""

    def discard_states(self, rows: Sequence[int]) -> None:
        """These rows' states may be wrong (a step that failed part-way may have advanced some of
        their layers): take no state of them from now until they are given back."""


class CacheMemory(Protocol):
    """The device tokens a prefix cache holds (`PrefixCache.memory`). `free + evictable + protected
    + held by running requests == total` holds at every step (`check`)."""

    @property
    def evictable(self) -> int:
        """Cached device tokens nobody holds: `evict` may free them."""

    @property
    def protected(self) -> int:
        """Cached device tokens some running request holds (`lock`)."""

    @property
    def reclaimable(self) -> int:
        """Evictable tokens no waiting request will reuse: what admission may take without cost."""

    def check(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
              running_rows: Sequence[int] = ()) -> None:
        """Sizes add up to the pool and no KV slot (or snapshot slot) is owned twice (running
        requests own `running_slots`, `held_by_running` tokens, and run in state rows
        `running_rows`); AssertionError otherwise."""


@runtime_checkable
class PrefixCache(Protocol):
    """Everything outside cache/ may ask of a prefix cache: the device pool it lives in, its parts
    (`states`, `memory`, `waiting`, `conversations`: see the module docstring) and seven methods.
    Sizes are in tokens of the device pool."""

    allocator: "PageAllocator"  # the device pool's pages (its page_size is the cache's)
    # The per-request state it keeps beyond KV (a hybrid model's recurrent-state snapshots), for
    # the few places that hand it a request's state row; None for a cache of KV alone.
    states: Optional["RequestStates"]
    memory: CacheMemory
    waiting: "WaitingView"
    conversations: "Conversations"

    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None, kv_only: bool = False) -> MatchResult:
        """The longest usable cached prefix ready on the device, split to end at a node's end;
        counts as an access for eviction. kv_only: by the KV alone, whatever other state is kept:
        what a running request holds of the positions it just inserted while it goes on reading
        them (the same match for a cache of KV alone)."""

    def lock(self, node: TreeNode) -> None:
        """Hold the path to node: a running request reads it (nothing on it is evicted)."""

    def unlock(self, node: TreeNode) -> None:
        """Let go of one `lock` of the path to node."""

    def admit(self, waiter: "Waiter", *, room: int, spare_only: bool) -> "Admission":
        """Admission reaches a waiting request: whether it may start now on the part of its prefix
        ready on the device, or waits for a copy of more of it from a lower tier (started here when
        `room` device tokens hold it; spare_only: taking only memory no waiting request needs). The
        Admission locks its prefix (`lock`), and counts (`commit`) or undoes (`cancel`) the start."""

    def insertable_len(self, computed: int) -> int:
        """Of a request's first `computed` positions (their KV computed), how many the cache takes
        (0: it keeps nothing)."""

    def insert(self, tokens: Sequence[int], slots: Sequence[int] | torch.Tensor, *,
               namespace: Optional[str] = None) -> int:
        """Add tokens (insertable_len of them) with their device slots; returns how many leading
        tokens were cached already. The caller frees slots[:returned] it did not get from the cache
        (duplicates); the cache owns slots[returned:]."""

    def evict(self, num_tokens: int) -> int:
        """Free up to num_tokens device slots nobody holds, in eviction order; returns those freed."""


class PublishedCache(Protocol):
    """What the page-event recorder (page_events.py) reads of the cache it listens to: the tree
    from its root, which paths a match could still end on, and the one listener slot it fills."""

    page_size: int
    root: TreeNode  # never matched, locked or evicted; every handle hangs below it
    events: Optional[PageEventListener]  # told of what the cache gains and loses

    def on_reusable_path(self, node: TreeNode) -> bool:
        """Whether a match could still end at or below node (the blocks /kv_events publishes): every
        node of a cache of KV alone; a snapshot cache's nodes with a snapshot at or below them."""

    def reusable_len(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> int:
        """How many leading tokens run along such paths (what /kv_events still publishes of them)."""


@runtime_checkable
class OwnedPrefixCache(PrefixCache, PublishedCache, Protocol):
    """The cache as the engine that builds it sees it (and the scheduler simulator standing in for
    the engine): the scheduler's protocol plus what the engine wires at start-up (the host tier's
    copier, the page-event publishers), flushes between runs and reports on /metrics. The
    scheduler never asks for these."""

    copier: Optional["CopyEngine"]  # the host tier's copy engine (None: no host tier)
    keeps_prefixes: bool  # False: it finds and keeps nothing (reported as /metrics' enable_prefix_caching)
    counters: CacheCounters  # written by the cache (its admissions, inserts and evictions)
    num_nodes: int

    def flush(self) -> bool:
        """Drop everything cached; refused (False) while any request holds a prefix."""

    # -- bookkeeping
    def reset_counters(self) -> None:
        ...

    def tier_stats(self) -> dict[str, float]:
        """The host tier's pool and traffic for /metrics (zeros without one: the same keys always)."""

    def snapshot_stats(self) -> dict[str, float]:
        """The recurrent-state snapshots' pool and traffic for /metrics (zeros without one)."""


def no_host_tier_stats() -> dict[str, float]:
    """`tier_stats()` of a cache without a host tier."""
    return {"host_pool_tokens": 0, "host_free_tokens": 0, "host_cached_tokens": 0, "loading_tokens": 0,
            "loaded_tokens": 0, "loaded_bytes": 0, "written_back_bytes": 0, "load_bandwidth_gbps": 0.0}


def no_snapshot_stats() -> dict[str, float]:
    """`snapshot_stats()` of a cache that keeps no recurrent-state snapshots."""
    return {"snapshot_slots": 0, "snapshots_held": 0, "snapshot_bytes": 0, "snapshot_hits": 0,
            "snapshots_taken": 0, "snapshot_evictions": 0, "checkpoints_taken": 0, "checkpoint_hits": 0,
            "host_snapshot_slots": 0, "host_snapshots_held": 0,
            "host_snapshot_bytes": 0, "host_snapshot_hits": 0, "snapshots_written_back": 0, "snapshots_loaded": 0,
            "host_snapshot_evictions": 0}


def check_slot_ownership(owned: Sequence[torch.Tensor], total: int, page_size: int, what: str = "KV") -> None:
    """Every slot of a pool of `total` slots (slot ids from page_size on: page 0 is the padding
    page) is owned exactly once by `owned` (the cache, the free list, running requests)."""
    every = torch.cat(list(owned)) if owned else torch.empty(0, dtype=torch.int64)
    assert every.numel() == total, f"{every.numel()} {what} slots owned, pool has {total}"
    # As many owners as slots, so a slot owned twice leaves another slot unowned.
    seen = torch.zeros(total + page_size, dtype=torch.bool)
    seen[every] = True
    assert bool(seen[page_size:].all()), f"a {what} slot is owned twice"
