"""The prefix cache of a hybrid model: the device radix tree of KV plus recurrent-state snapshots.

A hybrid model's linear-attention layers keep no KV: a request resumed after p cached tokens
needs their state after position p, which only a snapshot taken there can give
(`radixserve.cache.state_snapshots`). So the tree keeps, besides each node's KV, at most one
snapshot per node: the state after the node's last token (`TreeNode.snapshot`). A match is usable
only up to the deepest node end holding one: `peek`, `match`, the LPM order, the prefix hold,
`cached_tokens` and `/kv_events` all see that usable length, never the KV beyond it.

Where snapshots are taken, so that later requests find them:

- **Where a sequence ended**: a request that leaves (finished, aborted, retracted) hangs its
  row's state on the node where the KV it gave the tree ends (`keep_states` with `state_len`): the
  next turn of its conversation, or the request itself once it is readmitted, resumes there. A row
  holds one state, after its last computed position; with pages of more than one token it is kept
  only when that position ends a page (the tree holds whole pages).
- **Where requests branch**: when a request's KV match runs past its usable match (a shared system
  prompt computed before, but no snapshot where this request leaves it), the match asks the
  scheduler to end a prompt piece exactly at the end of the KV match (`MatchResult.chunk_ends`,
  when at least BRANCH_MIN_TOKENS would be saved); the step that computes that piece takes the
  state there (`take_state`), and the next request that branches off the same prefix resumes
  there.

When a snapshot is copied: a restore into an admitted request's row at once (`resume`); the state
at a chunk end once the step that computes it is launched: `take_state` is called while that step
is being scheduled, and the copy is issued at the next `poll` (the start of the next step's
scheduling, before any later forward pass advances the row) or when the row is given back; the
state at a sequence's end at once, when the request leaves (every step that advanced its row is
already queued before). A step that failed part-way leaves its rows' states suspect:
`discard_states` cancels what they had not copied yet and takes nothing more from them.

Eviction: snapshots have their own pool and budget. Taking one when the pool is full evicts the
snapshot the eviction policy picks among nodes no running request holds, those a waiting request
will resume from last (the KV's queue-aware order); when none can go, no snapshot is taken (never
an error: a later request computes a little more). A node evicted for KV frees its snapshot with
it, and leaves without a snapshot are evicted for KV first (their KV beyond the last snapshot can
only be computed again by whoever needs it). Every snapshot slot is owned exactly once: by a node,
by the row of a running request that took it and has not hung it on the tree yet, or by the free
list (`check_invariants`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import ALL, NAMESPACE, PARTIAL, MatchResult, TreeNode, no_snapshot_stats
from radixserve.cache.radix_cache import _EMPTY_SLOTS, RadixCache
from radixserve.cache.state_snapshots import StateSnapshots

# A branch point is worth a prompt piece of its own (one more step for the request that computes
# it, and a snapshot slot) only when it saves each later sibling at least this many tokens.
BRANCH_MIN_TOKENS = 16


@dataclass
class RowStates:
    """What the cache knows of a running request's state row."""
    chunk_ends: tuple[int, ...]
    # (position, snapshot slot) taken of the row and not hung on the tree yet.
    taken: list[tuple[int, int]] = field(default_factory=list)
    valid: bool = True  # False after discard_states: its state may be wrong


@dataclass
class SnapshotCounters:
    hits: int = 0  # admissions resumed from a snapshot
    taken: int = 0  # snapshots copied out of a request row
    evictions: int = 0  # snapshots freed to make room or with their node


class SnapshotRadixCache(RadixCache):
    def __init__(self, allocator: PageAllocator, snapshots: StateSnapshots, *, page_size: int = 1,
                 eviction_policy: str = "lru", branch_min_tokens: int = BRANCH_MIN_TOKENS):
        self._init_snapshots(snapshots, page_size, branch_min_tokens)
        super().__init__(allocator, page_size=page_size, eviction_policy=eviction_policy)

    def _init_snapshots(self, snapshots: StateSnapshots, page_size: int, branch_min_tokens: int) -> None:
        """What this class keeps beside the tree (before the tree is built: its reset reads none of it)."""
        self.snapshots = snapshots
        self.branch_min_tokens = max(branch_min_tokens, page_size)
        self.rows: dict[int, RowStates] = {}
        # (row, slot): states taken for the step being scheduled, copied once it is launched.
        self._unissued: list[tuple[int, int]] = []
        self.snapshot_counters = SnapshotCounters()

    def _reset(self) -> None:
        super()._reset()
        self.snapshots_held = 0
        self._snap_heap: list[tuple[tuple, TreeNode]] = []

    def reset_counters(self) -> None:
        super().reset_counters()
        self.snapshot_counters = SnapshotCounters()

    # ------------------------------------------------------------------ lookups
    def _usable_walk(self, tokens: Sequence[int], namespace: Optional[str], *,
                     ready: bool = True) -> tuple[int, TreeNode, int]:
        """(usable length, the node it ends at, KV match length): the deepest node end on the KV
        match with a snapshot there, ready on the device (else on any tier: what a lookup for a
        waiting request counts)."""
        usable, last, kv = 0, self._namespace_root(namespace) or self.root, 0
        on_device = True
        for node, n, pos in self._walk(tokens, namespace):
            kv = pos + n
            # A ready match has its whole path ready (a host tier's device part is a tree from the root).
            on_device = on_device and self._ready(node)
            if n == len(node.key) and (on_device or not ready) and self._resumable(node, ready):
                usable, last = kv, node
        return usable, last, kv

    def _resumable(self, node: TreeNode, ready: bool) -> bool:
        """A request can resume at node's end: it holds a snapshot (on the device, ready; the host
        tier's cache counts its host snapshots too when `ready` is False)."""
        return node.snapshot is not None and self._ready(node)

    def peek_park(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode, object]:
        """The usable length, parked at its node under the child key of the next page: a snapshot
        hung below that child (or a removed one at the node) touches it."""
        if self._namespace_root(namespace) is None:
            return 0, self.root, (NAMESPACE, namespace)
        usable, last, _ = self._usable_walk(tokens, namespace, ready=False)
        if usable + self.page_size > len(tokens):
            return usable, last, PARTIAL  # nothing left to match
        return usable, last, self._child_key(tokens, usable)

    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> MatchResult:
        """The usable prefix (its nodes accessed, none split: a snapshot sits at a node's end) and,
        where the KV match runs far enough past it, the end of the KV match as a chunk end."""
        tick = self._next_tick()
        usable, last, kv = self._usable_walk(tokens, namespace)
        pieces: list[torch.Tensor] = []
        node = last
        while node.parent is not None and node.namespace is None:
            node.last_access = tick
            node.hit_count += 1
            pieces.append(node.value)
            node = node.parent
        if last.lock_ref == 0 and self._evictable_leaf(last):
            self._push(last)  # its access time changed
        slots = torch.cat(pieces[::-1]) if pieces else _EMPTY_SLOTS
        chunk_ends = (kv,) if kv - usable >= self.branch_min_tokens else ()
        return MatchResult(usable, slots, last, chunk_ends)

    def on_reusable_path(self, node: TreeNode) -> bool:
        return node.snapshots_below > 0

    def reusable_len(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> int:
        """Along the KV match as long as a snapshot lies at or below the node reached."""
        length = 0
        for node, n, pos in self._walk(tokens, namespace):
            if node.snapshots_below == 0:
                break
            length = pos + n
        return length

    # ------------------------------------------------------------------ a request's state row
    def resume(self, row: int, match: MatchResult) -> tuple[int, ...]:
        assert row not in self.rows, f"state row {row} was not given back"
        self.rows[row] = RowStates(match.chunk_ends)
        if match.length:
            slot = match.last_node.snapshot
            assert slot is not None, f"a usable match ends at {match.last_node}, which holds no snapshot"
            if any(s == slot for _, s in self._unissued):
                self._issue()  # hung on the tree by a launched step whose copy is still queued here
            self.snapshots.restore([slot], [row])
            self.snapshot_counters.hits += 1
        return match.chunk_ends

    def take_state(self, row: int, position: int) -> None:
        states = self.rows[row]
        if not states.valid or any(p == position for p, _ in states.taken):
            return
        slot = self._alloc_snapshot()
        if slot is not None:  # no room: the next request branching there computes it again
            states.taken.append((position, slot))
            self._unissued.append((row, slot))

    @property
    def queued_saves(self) -> set[int]:
        """Snapshot slots whose copy out of a row is still queued here (their contents are not yet
        the state they will hold)."""
        return {slot for _, slot in self._unissued}

    def poll(self) -> bool:
        """The start of a step's scheduling: the steps that reached a chunk end are launched, so
        their states are copied out now, before a later forward pass moves their rows on."""
        self._issue()
        return super().poll()

    def _issue(self, row: Optional[int] = None) -> None:
        """Copy the taken states not copied yet (of `row` only, when given)."""
        if row is None:
            batch, self._unissued = self._unissued, []
        else:
            batch = [e for e in self._unissued if e[0] == row]
            self._unissued = [e for e in self._unissued if e[0] != row]
        if batch:
            self.snapshots.save([r for r, _ in batch], [s for _, s in batch])
            self.snapshot_counters.taken += len(batch)

    def keep_states(self, row: int, tokens: Sequence[int], *, namespace: Optional[str] = None,
                    state_len: Optional[int] = None) -> None:
        states = self.rows[row]
        leaving = state_len is not None
        if leaving:
            self._issue(row)  # the row goes to another request next: its state is read now
        n = len(tokens)
        waiting = []
        for position, slot in states.taken:
            if 0 < position <= n:
                self._attach(self._node_ending_at(tokens, position, namespace), slot, tokens[:position], namespace)
            else:
                waiting.append((position, slot))
        states.taken = waiting
        if not leaving:
            return
        if states.valid and state_len == n and n > 0:
            node = self._node_ending_at(tokens, n, namespace)
            if node is not None and node.snapshot is None:
                slot = self._alloc_snapshot()
                if slot is not None:
                    self.snapshots.save([row], [slot])
                    self.snapshot_counters.taken += 1
                    self._attach(node, slot, tokens, namespace)
        for _, slot in states.taken:
            self.snapshots.free(slot)
        del self.rows[row]

    def discard_states(self, rows: Sequence[int]) -> None:
        suspect = set(rows)
        cancelled = {e for e in self._unissued if e[0] in suspect}
        self._unissued = [e for e in self._unissued if e not in cancelled]
        for row in suspect:
            states = self.rows.get(row)
            if states is None:
                continue
            states.valid = False
            for entry in [(p, s) for p, s in states.taken if (row, s) in cancelled]:
                states.taken.remove(entry)
                self.snapshots.free(entry[1])

    # ------------------------------------------------------------------ the tree's snapshots
    def _node_ending_at(self, tokens: Sequence[int], position: int, namespace: Optional[str]) -> Optional[TreeNode]:
        """The node whose path is tokens[:position] (split there if it ends inside one); None when
        the tree does not hold them."""
        for node, n, pos in self._walk(tokens[:position], namespace):
            if pos + n == position:
                return node if n == len(node.key) else self._split(node, n)
        return None

    def _attach(self, node: Optional[TreeNode], slot: int, path: Sequence[int], namespace: Optional[str]) -> None:
        """Hang a taken snapshot on the node its position ends (freed if that node has one)."""
        if node is None or node.removed or node.snapshot is not None or not self._on_device(node):
            self.snapshots.free(slot)
            return
        node.snapshot = slot
        self.snapshots_held += 1
        self._count_below(node, +1)
        self._push_snapshot(node)
        if node.lock_ref == 0 and self._evictable_leaf(node):
            self._push(node)  # its eviction class changed
        # Lookups parked above it whose next page leads here may now resume deeper.
        child, above = node, node.parent
        while above is not None and child.namespace is None:
            self.touched.add((above, self._child_key(child.key, 0)))
            child, above = above, above.parent
        if self.event_listener is not None:
            self.event_listener("insert", list(path), namespace)

    def _drop_snapshot(self, node: TreeNode, *, removing: bool) -> None:
        """Free a node's snapshot (evicted: the pool needs room, or the node leaves the tree)."""
        self.snapshots.free(node.snapshot)
        node.snapshot = None
        self.snapshots_held -= 1
        self.snapshot_counters.evictions += 1
        self._count_below(node, -1)
        self.touched.add((node, ALL))  # lookups that resumed here
        if removing:
            return  # the tree's own removal re-offers the parent and publishes the eviction
        if node.lock_ref == 0 and self._evictable_leaf(node):
            self._push(node)  # its eviction class changed
        if node.snapshots_below == 0 and self.event_listener is not None:
            self.event_listener("evict", self._path_tokens(node), self._namespace_of(node))

    @staticmethod
    def _count_below(node: Optional[TreeNode], delta: int) -> None:
        while node is not None:
            node.snapshots_below += delta
            node = node.parent

    def _snapshot_priority(self, node: TreeNode) -> tuple:
        return (node.waiters > 0,) + self._policy_key(node)

    def _push_snapshot(self, node: TreeNode) -> None:
        heapq.heappush(self._snap_heap, (self._snapshot_priority(node), node))
        if len(self._snap_heap) > 4 * self.snapshots_held + 1024:
            holding = {n for _, n in self._snap_heap if not n.removed and n.snapshot is not None}
            self._snap_heap = [(self._snapshot_priority(n), n) for n in holding]
            heapq.heapify(self._snap_heap)

    def _alloc_snapshot(self) -> Optional[int]:
        """A free snapshot slot, evicting one snapshot if there is none; None when every snapshot is
        held by a running request."""
        slot = self.snapshots.alloc()
        if slot is not None:
            return slot
        held: list[tuple[tuple, TreeNode]] = []
        while self._snap_heap:
            prio, node = heapq.heappop(self._snap_heap)
            if node.removed or node.snapshot is None:
                continue
            if self._snapshot_held(node):
                held.append((prio, node))  # offered again once this search is over
                continue
            current = self._snapshot_priority(node)
            if prio != current:
                heapq.heappush(self._snap_heap, (current, node))
                continue
            self._drop_snapshot(node, removing=False)
            break
        for entry in held:
            heapq.heappush(self._snap_heap, entry)
        return self.snapshots.alloc()

    def _snapshot_held(self, node: TreeNode) -> bool:
        """Whether node's snapshot must stay: a running request (or a load) holds the node."""
        return node.lock_ref > 0

    def _snapshots_at(self, node: TreeNode) -> int:
        """Snapshots node holds (a host tier's cache: on either tier), as `snapshots_below` counts them."""
        return node.snapshot is not None

    # ------------------------------------------------------------------ the tree's hooks
    def _priority(self, node: TreeNode) -> tuple:
        # Leaves without a snapshot go first: their KV past the last snapshot resumes nobody.
        return (node.waiters > 0, node.snapshot is not None) + self._policy_key(node)

    def _publish_insert(self, tokens: Sequence[int], namespace: Optional[str]) -> None:
        """KV alone resumes nobody: /kv_events hears of a path when a snapshot is hung on it."""

    def _remove_leaf(self, node: TreeNode) -> int:
        if node.snapshot is not None:
            self._drop_snapshot(node, removing=True)
        return super()._remove_leaf(node)

    def _free_node_slots(self, node: TreeNode) -> None:
        super()._free_node_slots(node)
        if node.snapshot is not None:
            self.snapshots.free(node.snapshot)
            node.snapshot = None

    # ------------------------------------------------------------------ stats and checks
    def snapshot_stats(self) -> dict[str, float]:
        c = self.snapshot_counters
        return {**no_snapshot_stats(), "snapshot_slots": self.snapshots.num_slots,
                "snapshots_held": self.snapshots_held,
                "snapshot_bytes": self.snapshots_held * self.snapshots.bytes_per_slot, "snapshot_hits": c.hits,
                "snapshots_taken": c.taken, "snapshot_evictions": c.evictions}

    def check_invariants(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
                         running_rows: Sequence[int] = ()) -> None:
        """The KV tree's invariants, and every snapshot slot owned once (a node, a running request's
        row, the free list), the subtree counts right, every snapshot offered for eviction, and
        rows known exactly for the running requests."""
        super().check_invariants(held_by_running, running_slots, running_rows)
        owned: list[int] = []
        below: dict[int, int] = {}
        nodes = list(self.iter_nodes())
        for node in nodes:
            count = self._snapshots_at(node)
            if not count:
                continue
            assert node is not self.root and node.namespace is None, f"{node}: a root holds a snapshot"
            if node.snapshot is not None:
                assert self._on_device(node), f"{node} holds a device snapshot but no device KV"
                owned.append(node.snapshot)
            up: Optional[TreeNode] = node
            while up is not None:
                below[id(up)] = below.get(id(up), 0) + count
                up = up.parent
        for node in nodes:
            assert node.snapshots_below == below.get(id(node), 0), \
                f"{node}: {node.snapshots_below} snapshots below, counted {below.get(id(node), 0)}"
        assert len(owned) == self.snapshots_held, f"held counter {self.snapshots_held} != {len(owned)}"
        offered = {id(n) for _, n in self._snap_heap}
        assert all(id(n) in offered for n in nodes if n.snapshot is not None), "a snapshot can never be evicted"
        for states in self.rows.values():
            owned.extend(slot for _, slot in states.taken)
        owned.extend(self.snapshots.free_slot_list())
        assert sorted(owned) == list(range(self.snapshots.num_slots)), "a snapshot slot is owned twice or by no one"
        assert set(self.rows) == set(running_rows), f"state rows {sorted(self.rows)} != running {sorted(running_rows)}"
        assert {row for row, _ in self._unissued} <= set(self.rows), "a copy is queued for a row given back"
