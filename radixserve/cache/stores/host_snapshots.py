"""The snapshot store's host tier: a node's recurrent-state snapshot written back to a host slot
(`HostStateSnapshots`, its own budget: `--mamba-host-cache-size`) and loaded again.

A node's snapshot (`Snapshot`, stores/snapshots.py) lives on one tier at a time:

- **Write-back** (`to_host`): a device snapshot is copied to a host snapshot slot and its device
  slot freed when the device evicts its node (the node's KV keeps or gets a host copy), and when
  the device snapshot pool needs room for a newer snapshot (the node's KV stays on the device).
  With no host slot to be had, the snapshot is dropped (a longer prefix may hold one); a
  checkpoint (a guess nobody resumed from) is never worth the copy, but a prompt's or a sequence's
  end taken as a guess while its window learns whether they pay is on probation, not a checkpoint:
  it goes to the host as a kept snapshot (a conversation's next turn resumes there). Most snapshots never leave
  the device: one is written back only when it is evicted there, under either write policy.
- **Load** (`to_device`): a load of KV back from the host goes only up to the deepest snapshot on
  either tier (KV beyond it resumes nobody); the snapshots on it stay on the host. The one a
  request would resume from is copied to a device slot while the request waits in admission
  (`fetch`, asked by every admission of it: started with its KV load, right after it in the copy
  sequence, or alone when its KV is on the device); the request is admitted only once `poll` has
  seen the copy done, and a match uses the snapshot only then. The device slot is taken as
  `take_state` takes one (evicting a device snapshot nobody holds if the pool is full; one being
  written back may be taken at once: the load is queued after that copy). At most a quarter of the
  device pool loads at once (each evicts another snapshot). The snapshots a load passes over on
  the way are not copied (each is a running request's whole state: 151 MiB for the 27B).
- **Host eviction**: host snapshots are evicted by the same worth as device ones, waited-for ones
  last; a node leaving the tree frees its host snapshot. A device snapshot taken where the host
  holds one replaces it (`replaced`). With a storage tier, one evicted for room is handed to it
  first (`on_evict`), and one it reads back is hung on its node as a host snapshot (`adopt`).

So a device snapshot sits only at a node on the device, a host snapshot at a node with KV on
either tier, never both at one node (`check`); a match reported to a waiting request (`peek`)
runs to the deepest node end holding a snapshot on either tier; the device match (at admission)
stops at the deepest one on the device whose load, if any, is done: the request waited for the
one at the end of its KV's device part. The host part of a peeked match is its KV's host part:
the snapshot at its end comes back while the request waits, wherever its KV was.

Every copy of a snapshot between the tiers goes on the host tier's copy stream, numbered with the
KV copies (state_snapshots.py says how each hazard is covered: a written-back device slot is not
reused, nor a loaded one read, before its copy is done); under tensor parallelism they go to the
other ranks in the one copy log (copy_log.py) with their numbers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from radixserve.cache.lazy_heap import current_entries
from radixserve.cache.state_snapshots import HostStateSnapshots, StateSnapshots
from radixserve.cache.stores.snapshot_state import Snapshot
from radixserve.cache.tree import ALL, RadixTree, TreeNode


class SnapshotOwner(Protocol):
    """What of the snapshot store (stores/snapshots.py) its host tier uses: the device pool and
    its eviction, the worth and recency of a snapshot, and the tree's bookkeeping of snapshots."""
    snapshots: StateSnapshots
    snapshots_held: int
    tree: RadixTree
    kv_host: object  # stores.host_kv.HostKV: whether a load being prepared reads a node's host KV

    @property
    def queued_saves(self) -> set[int]: ...

    def issue(self, row: Optional[int] = None) -> None: ...

    def count_below(self, node: TreeNode, delta: int) -> None: ...

    def lost(self, node: TreeNode) -> None: ...

    def _alloc_snapshot(self, *, evict_waited: bool = False, worth: Optional[float] = None) -> Optional[int]: ...

    def _recency(self, node: TreeNode) -> int: ...

    def _push_snapshot(self, node: TreeNode) -> None: ...

    def _snapshot_priority(self, node: TreeNode) -> tuple: ...

    def _end_outcome(self, node: TreeNode, *, resumed: bool) -> None: ...

    def _on_probation(self, node: TreeNode) -> bool: ...


@dataclass
class HostSnapshotCounters:
    hits: int = 0  # admissions resumed from a snapshot loaded back from the host
    written_back: int = 0  # snapshots copied to the host with their node's KV
    loaded: int = 0  # snapshots copied back to the device
    evictions: int = 0  # host snapshots freed for room or with their node


class HostSnapshots:
    def __init__(self, snapshots: HostStateSnapshots):
        self.snapshots = snapshots
        self.counters = HostSnapshotCounters()
        self.store: SnapshotOwner
        # The storage tier's save of a host snapshot evicted for room (disk_snapshots.py; None: none).
        self.on_evict: Optional[Callable[[TreeNode], None]] = None
        self.reset()

    def bind(self, store: SnapshotOwner) -> None:
        self.store = store

    def reset(self) -> None:
        self.held = 0
        self._heap: list[tuple[tuple, TreeNode]] = []
        self._loading: list[tuple[int, TreeNode]] = []  # (copy number, node) of loads maybe in flight

    def reset_counters(self) -> None:
        self.counters = HostSnapshotCounters()

    # ------------------------------------------------------------------ between the tiers
    def loading(self, node: TreeNode) -> bool:
        """node's device snapshot is still being copied back from the host."""
        state = node.state
        return state is not None and state.slot is not None and state.loading_seq > self.snapshots.copier.done_seq

    def fetch(self, node: Optional[TreeNode]) -> bool:
        """Admission asks of a waiting request whose peeked match ends at node: the snapshot it would
        resume from now (the deepest on its path's device part) is copied back to the device if it
        lies on the host. True while the request must wait for such a copy (started here or before;
        or every copy the pool allows is in flight); False when it may start (its snapshot is on
        the device, or no device slot can be had: it resumes above)."""
        if node is None or node.removed or not (self.held or self._loading):
            return False  # nothing on the host, nothing loading
        path = []
        while node.parent is not None and node.namespace is None:
            path.append(node)
            node = node.parent
        target = None
        for n in reversed(path):
            if n.value is None:  # on the host only (a load of its KV may start later)
                break
            if n.state is not None and n.state.held:
                target = n
        if target is None:
            return False
        if target.state.slot is not None:
            return self.loading(target)
        done = self.snapshots.copier.done_seq
        self._loading = [(seq, n) for seq, n in self._loading if seq > done and not n.removed]
        if len(self._loading) >= max(1, self.store.snapshots.num_slots // 4):
            return True  # others' loads first: each takes a device slot, evicting another snapshot
        self.to_device(target)
        return target.state is not None and self.loading(target)

    def to_device(self, node: TreeNode) -> None:
        """Copy node's host snapshot to a device slot (taken as `take_state` takes one, evicting a
        device snapshot nobody holds if the pool is full), on the copy stream: usable once the copy
        is seen done (`loading`); it stays on the host when every device snapshot is held."""
        store, state = self.store, node.state
        host_slot = state.host_slot
        state.host_slot = None  # out of host eviction's reach while the device pool makes room
        slot = store._alloc_snapshot(evict_waited=True)
        if slot is None:  # the one evicted for room (or another) may still be written back
            slot = store.snapshots.alloc(behind_copies=True)
        if slot is None:
            state.host_slot = host_slot
            self._push(node)
            return
        self.held -= 1
        state.loading_seq = self.snapshots.load([host_slot], [slot])
        self._loading.append((state.loading_seq, node))
        self.snapshots.free(host_slot)  # reused only by copies queued after this one, on the same stream
        self.counters.loaded += 1
        state.slot = slot
        state.worth = None  # only kept snapshots go to the host
        state.used = store._recency(node)
        state.from_host = True
        store.snapshots_held += 1
        store._push_snapshot(node)

    def to_host(self, node: TreeNode) -> bool:
        """Copy node's device snapshot to a host slot and free the device one; False when no host
        slot can be had, or when it is a checkpoint (a guess nobody resumed from is not worth the
        copy, nor a host slot: the device snapshot stays, for the caller to drop). A prompt's or a
        sequence's end taken as a guess while its window learns is not a checkpoint: it goes to
        the host as a kept snapshot (`_on_probation`: a conversation's next turn resumes there)."""
        store, state = self.store, node.state
        if state.worth is not None and not store._on_probation(node):
            return False
        host_slot = self._alloc()
        if host_slot is None:
            return False
        state.worth = None  # kept on the host, as it is once loaded back
        if state.slot in store.queued_saves:
            store.issue()  # hung on the tree by a launched step whose copy is still queued there
        state.written_seq = self.snapshots.write_back([state.slot], [host_slot])
        store.snapshots.free(state.slot)  # reused once the copy is done (or by a load queued after it)
        state.slot = None
        state.from_host = False
        store.snapshots_held -= 1
        state.host_slot = host_slot
        self.held += 1
        self.counters.written_back += 1
        self._push(node)
        return True

    def adopt(self, node: TreeNode, fill: Callable[[int], None], *, saves: int = 1) -> bool:
        """Hang a snapshot from outside the tree (the storage tier's, read from disk) on node, which
        holds KV on either tier and no snapshot: a host slot (evicting as a write-back does), filled
        by fill(slot); False when no host slot can be had. From here it is a host snapshot like any:
        a load brings it back with the KV, and a resume from it counts as a host hit."""
        store = self.store
        host_slot = self._alloc()
        if host_slot is None:
            return False
        if node.removed or (node.state is not None and node.state.held):
            self.snapshots.free(host_slot)
            return not node.removed
        fill(host_slot)
        state = node.state
        if state is None:
            state = node.state = Snapshot(None)
        state.host_slot, state.worth, state.saves, state.from_host = host_slot, None, saves, False
        state.used = store._recency(node)
        self.held += 1
        store.count_below(node, +1)
        self._push(node)
        tree = store.tree
        if node.value is not None:
            tree.push_if_evictable(node)  # its eviction class changed
        # Lookups parked above it whose next page leads here may now resume deeper.
        child, above = node, node.parent
        while above is not None and child.namespace is None:
            tree.touched.add((above, tree.child_key(child.key, 0)))
            child, above = above, above.parent
        if tree.events is not None:  # its path is a usable prefix now
            tree.events.usable(node)
        return True

    def replaced(self, node: TreeNode) -> None:
        """A device snapshot is hung where node's host snapshot lies: the host one goes."""
        self.snapshots.free(node.state.host_slot)
        node.state.host_slot = None
        self.held -= 1
        self.store.count_below(node, -1)

    def free(self, node: TreeNode) -> None:
        """Free node's host snapshot (evicted for room, or with its node)."""
        self.snapshots.free(node.state.host_slot)
        node.state.host_slot = None
        self.store._end_outcome(node, resumed=False)
        node.state = None
        self.held -= 1
        self.counters.evictions += 1

    # ------------------------------------------------------------------ the host slots
    def _push(self, node: TreeNode) -> None:
        priority = self.store._snapshot_priority
        heapq.heappush(self._heap, (priority(node), node))
        if len(self._heap) > 4 * self.held + 1024:
            holding = {n for _, n in self._heap if not n.removed and n.state is not None and n.state.host_slot is not None}
            self._heap = [(priority(n), n) for n in holding]
            heapq.heapify(self._heap)

    def _alloc(self) -> Optional[int]:
        """A free host snapshot slot, evicting the least worth host snapshot if there is none
        (not one a load being prepared will read); None when none can go."""
        slot = self.snapshots.alloc()
        if slot is not None:
            return slot
        store = self.store
        host_kv = store.kv_host
        reserved: list[tuple[tuple, TreeNode]] = []  # offered again once this search is over
        for _, node in current_entries(
                self._heap, store._snapshot_priority, held=host_kv.reserved, kept=reserved,
                gone=lambda n: n.removed or n.state is None or n.state.host_slot is None):
            if self.on_evict is not None:
                self.on_evict(node)
            self.free(node)
            store.count_below(node, -1)
            store.tree.touched.add((node, ALL))  # lookups resumed there look again
            store.lost(node)
            break
        for entry in reserved:
            heapq.heappush(self._heap, entry)
        return self.snapshots.alloc()

    # ------------------------------------------------------------------ stats and checks
    def stats(self) -> dict[str, float]:
        c, host = self.counters, self.snapshots
        return {"host_snapshot_slots": host.num_slots, "host_snapshots_held": self.held,
                "host_snapshot_bytes": self.held * host.bytes_per_slot,
                "host_snapshot_hits": c.hits, "snapshots_written_back": c.written_back,
                "snapshots_loaded": c.loaded, "host_snapshot_evictions": c.evictions}

    def check(self, nodes: Sequence[TreeNode]) -> None:
        """Every host snapshot slot owned once (a node with KV on either tier, or the free list),
        each offered for host eviction."""
        owned: list[int] = []
        offered = {id(n) for _, n in self._heap}
        for node in nodes:
            state = node.state
            if state is None or state.host_slot is None:
                continue
            assert node.value is not None or node.host is not None, f"{node} holds a host snapshot but no KV"
            assert id(node) in offered, f"{node}'s host snapshot can never be evicted"
            owned.append(state.host_slot)
        assert len(owned) == self.held, f"host snapshot counter {self.held} != {len(owned)}"
        owned.extend(self.snapshots.free_slot_list())
        assert sorted(owned) == list(range(self.snapshots.num_slots)), \
            "a host snapshot slot is owned twice or by no one"
