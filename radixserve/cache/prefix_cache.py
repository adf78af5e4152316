"""The prefix cache as the scheduler, the engine and the event publishers see it: one protocol,
the tree node it hands out as a handle, and the result and counter types they share.

Two implementations:

- `RadixCache` (radix_cache.py): the radix tree (tree.py) and the stores beside it (stores/): the
  device KV always; a host tier under it (a prefix evicted from the device is copied to the host
  and loaded back); a hybrid model's recurrent-state snapshots (state_snapshots.py), on the
  device and with a host tier on the host too. `factory.tree_cache` picks the stores.
- `NoPrefixCache` (no_cache.py): `--disable-radix-cache`. Nothing is kept or found; a request
  computes its whole prompt and frees its KV when it leaves.

How a request uses it (scheduler/kv_manager.py and waiting_queue.py): while it waits, `peek_park`
says how much of its prompt is cached (on any tier) and where to park it, `add_waiter` marks that
path as wanted (queue-aware eviction) and `admit_ahead` starts the copies of lower-tier parts it
will wait for (`poll` takes them in). When admission reaches it, `admit` says whether it starts
now or waits for such a copy; the `Admission` it returns (cache/admission.py) locks the device
part ready to read (`match`, `inc_lock`) and puts into the request's state row whatever else the
match needs. What it computes goes back with `insert` (as much as `insertable_len` says the cache
takes) and, where the cache keeps states (`states`), `keep_states`, and `dec_lock` lets go.
`evict` makes room on demand.

Every lookup and insert names the request's cache namespace (`cache/namespace.py`: its
`cache_salt`, and its API key with `--cache-salt-per-api-key`; None: the shared one). Prefixes
of different namespaces are never shared: the tree keeps each namespace under its own child of the
root, so everything else works in it as in the shared one.

What a cache holds is per position: a match is usable only up to the deepest position every
kind of state it keeps is there for, and `peek`/`match` report that usable length. For a model of
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
from typing import TYPE_CHECKING, Iterator, Optional, Protocol, Sequence, runtime_checkable

import torch

from radixserve.cache.tree import ALL, PageEventListener, TreeNode

# The tree's node is the handle the scheduler holds, and ALL the park key of a removed node.
__all__ = ["ALL", "CacheCounters", "MatchResult", "OwnedPrefixCache", "PrefixCache", "RequestStates", "TreeNode", "check_slot_ownership",
           "no_host_tier_stats", "no_snapshot_stats"]

if TYPE_CHECKING:
    from collections import deque

    from radixserve.cache.admission import Admission, Waiter
    from radixserve.cache.host_pool import CopyEngine
    from radixserve.cache.kv_pool import PageAllocator

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
    recurrent state, stores/snapshots.py), as the scheduler and the model runner drive it: the
    request runs in a state row; its prompt pieces end where the cache keeps a state
    (`Admission.chunk_ends`)."""

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


@runtime_checkable
class PrefixCache(Protocol):
    """Everything outside cache/ may ask of a prefix cache. Sizes are in tokens of the device pool
    unless they say otherwise; `free + evictable_size + protected_size + held by running requests
    == total` holds at every step (`check_invariants`)."""

    allocator: "PageAllocator"  # the device pool's pages
    page_size: int
    root: TreeNode  # never matched, locked or evicted; every handle hangs below it
    evictable_size: int  # cached device tokens nobody holds: evict() may free them
    protected_size: int  # cached device tokens some running request holds (inc_lock)
    # The per-request state it keeps beyond KV (a hybrid model's recurrent-state snapshots), for
    # the few places that hand it a request's state row; None for a cache of KV alone.
    states: Optional["RequestStates"]
    events: Optional[PageEventListener]  # told of what the cache gains and loses (page_events.py)

    @property
    def reclaimable_size(self) -> int:
        """Evictable tokens no waiting request will reuse: what admission may take without cost."""

    # -- lookups: never change what is cached
    def peek_park(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode, object]:
        """As peek, plus the park key: which change under that node could lengthen the match."""

    def extends_a_prompt(self, node: TreeNode, uncached: Optional[int] = None) -> bool:
        """Whether a match ending at node continues a finished request's prompt (a conversation)."""

    # -- taking a prefix
    def admit(self, waiter: "Waiter", *, room: int, spare_only: bool) -> "Admission":
        """Admission reaches a waiting request: whether it may start now on the part of its prefix
        ready on the device, or waits for a copy of more of it from a lower tier (started here when
        `room` device tokens hold it; spare_only: taking only memory no waiting request needs). The
        Admission locks its prefix (`lock`), and counts (`commit`) or undoes (`cancel`) the start."""

    def admit_ahead(self, arrivals: "deque[Waiter]", room: int) -> int:
        """Start the copies newly arrived requests will wait for, within `room` device tokens;
        drops from `arrivals` those looked at. Returns the device tokens those copies take."""

    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> MatchResult:
        """The longest usable cached prefix ready on the device, split to end at a node's end;
        counts as an access for eviction."""

    def match_kv(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> MatchResult:
        """As match, by the KV alone (whatever other state is kept): what a running request holds
        of the positions it just inserted while it goes on reading them (equal to match for a cache
        of KV alone)."""

    def inc_lock(self, node: TreeNode) -> None:
        """Hold the path to node: a running request reads it."""

    def dec_lock(self, node: TreeNode) -> None:
        ...

    def add_waiter(self, node: TreeNode) -> None:
        """A waiting request will reuse the path to node: evict it only when nothing else is left."""

    def remove_waiter(self, node: TreeNode) -> None:
        ...

    # -- giving computed KV to the cache
    def insertable_len(self, computed: int) -> int:
        """Of a request's first `computed` positions (their KV computed), how many the cache takes
        (0: it keeps nothing)."""

    def insert(self, tokens: Sequence[int], slots: Sequence[int] | torch.Tensor, *,
               namespace: Optional[str] = None) -> int:
        """Add tokens (insertable_len of them) with their device slots; returns how many leading
        tokens were cached already. The caller frees slots[:returned] it did not get from the cache
        (duplicates); the cache owns slots[returned:]."""

    def mark_prompt_end(self, prompt: Sequence[int], beyond: int, locked: Optional[tuple[TreeNode, int]] = None, *,
                        namespace: Optional[str] = None) -> None:
        """Remember where a finished request's prompt ended (see extends_a_prompt)."""

    # -- memory
    def evict(self, num_tokens: int) -> int:
        """Free up to num_tokens device slots nobody holds, in eviction order; returns those freed."""

    def poll(self) -> bool:
        """Take in finished host-tier copies; True when a load finished."""

    def drain_touched(self) -> set[tuple[TreeNode, object]]:
        """(node, park key) pairs whose lookups may have changed since the last call."""

    def iter_nodes(self) -> Iterator[TreeNode]:
        ...

    def on_reusable_path(self, node: TreeNode) -> bool:
        """Whether a match could still end at or below node (the blocks /kv_events publishes): every
        node of a cache of KV alone; a snapshot cache's nodes with a snapshot at or below them."""

    def reusable_len(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> int:
        """How many leading tokens run along such paths (what /kv_events still publishes of them)."""

    def check_invariants(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
                         running_rows: Sequence[int] = ()) -> None:
        """Sizes add up to the pool and no KV slot (or snapshot slot) is owned twice (running
        requests own `running_slots`, `held_by_running` tokens, and run in state rows
        `running_rows`); AssertionError otherwise."""


@runtime_checkable
class OwnedPrefixCache(PrefixCache, Protocol):
    """The cache as the engine that builds it sees it (and the scheduler simulator standing in for
    the engine): the scheduler's protocol plus what the engine wires at start-up, flushes between
    runs and reports on /metrics. The scheduler never asks for these."""

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
