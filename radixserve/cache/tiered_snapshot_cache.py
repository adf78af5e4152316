"""The prefix cache of a hybrid model over two tiers: the snapshot tree (snapshot_cache.py) on
the host tier's tree (tiered_cache.py), with the host tier keeping snapshots too.

A node's snapshot (the recurrent state after its last token) lives on one tier at a time:

- **Write-back**: a device snapshot is copied to a host snapshot slot (`HostStateSnapshots`, its
  own budget: `--mamba-host-cache-size`) and its device slot freed when the device evicts its
  node (the node's KV keeps or gets a host copy), and when the device snapshot pool needs room
  for a newer snapshot (the node's KV stays on the device). With no host slot to be had, the
  snapshot is dropped (a longer prefix may hold one). Most snapshots never leave the device: one
  is written back only when it is evicted there, under either write policy.
- **Load**: a load copies a host part's KV back (`load`, only up to the deepest host snapshot on
  the match: KV beyond it resumes nobody); the snapshots on it stay on the host. The one a request
  resumes from is copied to a device slot when the request is admitted on it (`match`; the slot
  is taken as `take_state` takes one, evicting a device snapshot nobody holds if the pool is
  full): the copy is queued ahead of the restore that reads it. The snapshots a load passes over
  on the way are not copied (each is a running request's whole state: 151 MiB for the 27B).
- **Host eviction**: host snapshots are evicted LRU, waited-for ones last, as host KV is; a node
  leaving the tree frees its host snapshot. A device snapshot taken where the host holds one
  replaces it.

So a device snapshot sits only at a node on the device, a host snapshot at a node with KV on
either tier, never both at one node (`check_invariants`); a match reported to a waiting request
(`peek`) runs to the deepest node end holding a snapshot on either tier, KV on either tier being
there by the tree's own rule; the device match (`match`) stops at the deepest one on the device
once it has brought back the host one at the end of the KV's device part. The host part of a
peeked match (`host_part`) is its KV's host part: the snapshot at its end comes back at
admission, wherever its KV was.

Every copy of a snapshot between the tiers is queued on the compute stream (state_snapshots.py
says why that orders them with everything else); under tensor parallelism they go to the other
ranks with the device snapshot copies.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from radixserve.cache.host_pool import CopyEngine, HostKVPool
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import ALL, MatchResult, TreeNode
from radixserve.cache.snapshot_cache import BRANCH_MIN_TOKENS, SnapshotRadixCache
from radixserve.cache.state_snapshots import HostStateSnapshots, StateSnapshots
from radixserve.cache.tiered_cache import _RESERVED, HostTierNode, TieredRadixCache


class HostSnapshotNode(HostTierNode):
    """A host-tier node that may hold its snapshot in the host tier."""

    __slots__ = ("host_snapshot", "snapshot_from_host")

    def __init__(self, key: list[int], value: Optional[torch.Tensor], parent: Optional[TreeNode], tick: int,
                 node_id: int):
        super().__init__(key, value, parent, tick, node_id)
        self.host_snapshot: Optional[int] = None  # host snapshot slot (only while the node is host-only)
        self.snapshot_from_host = False  # its device snapshot was loaded back and no request resumed from it yet


@dataclass
class HostSnapshotCounters:
    hits: int = 0  # admissions resumed from a snapshot loaded back from the host
    written_back: int = 0  # snapshots copied to the host with their node's KV
    loaded: int = 0  # snapshots copied back to the device
    evictions: int = 0  # host snapshots freed for room or with their node


class TieredSnapshotRadixCache(SnapshotRadixCache, TieredRadixCache):
    node_type = HostSnapshotNode

    def __init__(self, allocator: PageAllocator, snapshots: StateSnapshots, host_pool: HostKVPool,
                 copier: CopyEngine, host_snapshots: Optional[HostStateSnapshots], *, page_size: int = 1,
                 eviction_policy: str = "lru", write_through: bool = False,
                 branch_min_tokens: int = BRANCH_MIN_TOKENS):
        self.host_snapshots = host_snapshots
        self.host_snapshot_counters = HostSnapshotCounters()
        self._init_snapshots(snapshots, page_size, branch_min_tokens)
        TieredRadixCache.__init__(self, allocator, host_pool, copier, page_size=page_size,
                                  eviction_policy=eviction_policy, write_through=write_through)

    def _reset(self) -> None:
        super()._reset()
        self.host_snapshots_held = 0
        self._host_snap_heap: list[tuple[tuple, HostSnapshotNode]] = []

    def reset_counters(self) -> None:
        super().reset_counters()
        self.host_snapshot_counters = HostSnapshotCounters()

    # ------------------------------------------------------------------ lookups and loads
    def _resumable(self, node: HostSnapshotNode, ready: bool) -> bool:
        if ready:
            return super()._resumable(node, ready)
        return node.snapshot is not None or node.host_snapshot is not None

    def load(self, tokens: Sequence[int], *, spare_only: bool, namespace: Optional[str] = None) -> int:
        """As the host tier's load, up to the deepest snapshot on either tier only."""
        usable, _, _ = self._usable_walk(tokens, namespace, ready=False)
        if not usable:
            return 0
        return super().load(tokens[:usable], spare_only=spare_only, namespace=namespace)

    def resume(self, row: int, match: MatchResult, *, branch_at: int = 0,
               hints: Sequence[int] = ()) -> tuple[int, ...]:
        node = match.last_node
        from_host = bool(match.length) and node.snapshot_from_host
        if from_host:
            node.snapshot_from_host = False
            self.host_snapshot_counters.hits += 1
        chunk_ends = super().resume(row, match, branch_at=branch_at, hints=hints)
        self.rows[row].from_host = from_host
        return chunk_ends

    def cancel_resume(self, row: int) -> None:
        states = self.rows[row]
        if states.from_host:
            self.host_snapshot_counters.hits -= 1
            states.resumed_from.snapshot_from_host = True
        super().cancel_resume(row)

    def _snapshot_held(self, node: HostSnapshotNode) -> bool:
        return self._loading(node)

    def _snapshots_at(self, node: HostSnapshotNode) -> int:
        return (node.snapshot is not None) + (node.host_snapshot is not None)

    # ------------------------------------------------------------------ between the tiers
    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> MatchResult:
        """As the device match, after bringing back a host snapshot lying past the deepest device
        one on the device part of the match (the device pool had evicted it to the host)."""
        deepest: Optional[HostSnapshotNode] = None
        for node, n, _ in self._walk(tokens, namespace):
            if not self._ready(node):
                break
            if n == len(node.key) and self._snapshots_at(node):
                deepest = node
        if deepest is not None and deepest.snapshot is None:
            self._snapshot_to_device(deepest)
        return super().match(tokens, namespace=namespace)

    def _snapshot_to_device(self, node: HostSnapshotNode) -> None:
        """Copy node's host snapshot to a device slot (taken as `take_state` takes one, evicting a
        device snapshot nobody holds if the pool is full); it stays on the host when every device
        snapshot is held."""
        host_slot = node.host_snapshot
        node.host_snapshot = None  # out of host eviction's reach while the device pool makes room
        slot = self._alloc_snapshot(evict_waited=True)
        if slot is None:
            node.host_snapshot = host_slot
            self._push_host_snapshot(node)
            return
        self.host_snapshots_held -= 1
        self.host_snapshots.load([host_slot], [slot])
        self.host_snapshots.free(host_slot)  # reused only by copies queued after this one
        self.host_snapshot_counters.loaded += 1
        node.snapshot = slot
        node.snapshot_worth = None  # only kept snapshots go to the host
        node.snapshot_used = self._recency(node)
        node.snapshot_from_host = True
        self.snapshots_held += 1
        self._push_snapshot(node)

    def _drop_device(self, node: HostSnapshotNode) -> None:
        """The device evicts node (its KV on the host now): its snapshot goes to the host too."""
        if node.snapshot is not None and not self._snapshot_to_host(node):
            self._drop_snapshot(node, removing=False)
        super()._drop_device(node)

    def _evict_snapshot(self, node: HostSnapshotNode) -> None:
        """The device snapshot pool needs room: node's snapshot moves to the host tier (its KV stays
        on the device), or is dropped when no host slot can be had."""
        if not self._snapshot_to_host(node):
            super()._evict_snapshot(node)

    def _snapshot_to_host(self, node: HostSnapshotNode) -> bool:
        """Copy node's device snapshot to a host slot and free the device one; False when no host
        slot can be had, or when it is a checkpoint (a guess nobody resumed from is not worth the
        copy, nor a host slot: the device snapshot stays, for the caller to drop)."""
        if node.snapshot_worth is not None:
            return False
        host_slot = self._alloc_host_snapshot()
        if host_slot is None:
            return False
        if any(s == node.snapshot for _, s in self._unissued):
            self._issue()  # hung on the tree by a launched step whose copy is still queued here
        self.host_snapshots.write_back([node.snapshot], [host_slot])
        self.snapshots.free(node.snapshot)  # reused only by copies queued after this one
        node.snapshot = None
        node.snapshot_from_host = False
        self.snapshots_held -= 1
        node.host_snapshot = host_slot
        self.host_snapshots_held += 1
        self.host_snapshot_counters.written_back += 1
        self._push_host_snapshot(node)
        return True

    def _attach(self, node: Optional[HostSnapshotNode], slot: int, path: Sequence[int],
                namespace: Optional[str], *, worth: Optional[float] = None, hinted: bool = False,
                saves: int = 1) -> bool:
        """As the device cache's; a device snapshot taken where the host tier holds one replaces it
        (the same state, ready on the device)."""
        if node is not None and not node.removed and node.host_snapshot is not None and self._on_device(node):
            self.host_snapshots.free(node.host_snapshot)
            node.host_snapshot = None
            self.host_snapshots_held -= 1
            self._count_below(node, -1)
        return super()._attach(node, slot, path, namespace, worth=worth, hinted=hinted, saves=saves)

    def _drop_snapshot(self, node: HostSnapshotNode, *, removing: bool) -> None:
        node.snapshot_from_host = False  # a snapshot hung here later was taken on the device
        super()._drop_snapshot(node, removing=removing)

    def _lost_snapshot(self, node: HostSnapshotNode) -> None:
        """node's only snapshot was freed (it stays in the tree): lookups resumed there look again."""
        self._count_below(node, -1)
        self.touched.add((node, ALL))
        if self._on_device(node) and node.lock_ref == 0 and self._evictable_leaf(node):
            self._push(node)  # its eviction class changed
        if node.snapshots_below == 0 and self.event_listener is not None:
            self.event_listener("evict", self._path_tokens(node), self._namespace_of(node))

    # ------------------------------------------------------------------ the host snapshots
    def _push_host_snapshot(self, node: HostSnapshotNode) -> None:
        heapq.heappush(self._host_snap_heap, (self._snapshot_priority(node), node))
        if len(self._host_snap_heap) > 4 * self.host_snapshots_held + 1024:
            holding = {n for _, n in self._host_snap_heap if not n.removed and n.host_snapshot is not None}
            self._host_snap_heap = [(self._snapshot_priority(n), n) for n in holding]
            heapq.heapify(self._host_snap_heap)

    def _alloc_host_snapshot(self) -> Optional[int]:
        """A free host snapshot slot, evicting the least recently used host snapshot if there is none
        (not one a load being prepared will read); None when none can go."""
        if self.host_snapshots is None:
            return None  # --mamba-host-cache-size 0
        slot = self.host_snapshots.alloc()
        if slot is not None:
            return slot
        reserved: list[tuple[tuple, HostSnapshotNode]] = []
        while self._host_snap_heap:
            prio, node = heapq.heappop(self._host_snap_heap)
            if node.removed or node.host_snapshot is None:
                continue
            if node.host_seq == _RESERVED:
                reserved.append((prio, node))  # offered again once this search is over
                continue
            current = self._snapshot_priority(node)
            if prio != current:
                heapq.heappush(self._host_snap_heap, (current, node))
                continue
            self._free_host_snapshot(node)
            self._lost_snapshot(node)
            break
        for entry in reserved:
            heapq.heappush(self._host_snap_heap, entry)
        return self.host_snapshots.alloc()

    def _free_host_snapshot(self, node: HostSnapshotNode) -> None:
        self.host_snapshots.free(node.host_snapshot)
        node.host_snapshot = None
        self._end_outcome(node, resumed=False)
        self.host_snapshots_held -= 1
        self.host_snapshot_counters.evictions += 1

    # ------------------------------------------------------------------ the tree's hooks
    def _remove_leaf(self, node: HostSnapshotNode) -> int:
        if node.host_snapshot is not None:
            self._free_host_snapshot(node)
            self._count_below(node, -1)
        return super()._remove_leaf(node)

    def _free_node_slots(self, node: HostSnapshotNode) -> None:
        if node.host_snapshot is not None:
            self.host_snapshots.free(node.host_snapshot)
            node.host_snapshot = None
        super()._free_node_slots(node)

    # ------------------------------------------------------------------ stats and checks
    def snapshot_stats(self) -> dict[str, float]:
        c, host = self.host_snapshot_counters, self.host_snapshots
        return {**super().snapshot_stats(), "host_snapshot_slots": host.num_slots if host else 0,
                "host_snapshots_held": self.host_snapshots_held,
                "host_snapshot_bytes": self.host_snapshots_held * host.bytes_per_slot if host else 0,
                "host_snapshot_hits": c.hits, "snapshots_written_back": c.written_back,
                "snapshots_loaded": c.loaded, "host_snapshot_evictions": c.evictions}

    def check_invariants(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
                         running_rows: Sequence[int] = ()) -> None:
        """Both caches' invariants, and every host snapshot slot owned once (a host-only node with
        host KV, or the free list), each offered for host eviction."""
        super().check_invariants(held_by_running, running_slots, running_rows)
        owned: list[int] = []
        offered = {id(n) for _, n in self._host_snap_heap}
        for node in self.iter_nodes():
            if node.host_snapshot is None:
                continue
            assert node.value is not None or node.host_value is not None, f"{node} holds a host snapshot but no KV"
            assert node.snapshot is None, f"{node} holds a snapshot on both tiers"
            assert id(node) in offered, f"{node}'s host snapshot can never be evicted"
            owned.append(node.host_snapshot)
        assert len(owned) == self.host_snapshots_held, f"host snapshot counter {self.host_snapshots_held} != {len(owned)}"
        if self.host_snapshots is None:
            assert not owned, "host snapshots without a host snapshot pool"
            return
        owned.extend(self.host_snapshots.free_slot_list())
        assert sorted(owned) == list(range(self.host_snapshots.num_slots)), \
            "a host snapshot slot is owned twice or by no one"

