"""The prefix cache: one radix tree (`tree.py`) and the stores beside it (`stores/`).

Every cache the server builds is this class; what differs is which stores it has
(`factory.tree_cache` chooses): always the device KV (`stores.device_kv`); a host tier under it
(`stores.host_kv`: a prefix evicted from the device is copied to the host and loaded back); a
hybrid model's recurrent-state snapshots (`stores.snapshots`, with their own host tier,
`stores.host_snapshots`). Without a store, what it would do is not done: with no host tier the
host operations (`host_part`, `load`, `waiting.poll`) find nothing to do; with no snapshot
store every position of the KV is usable and a request keeps no state.

What a cache holds is usable per position: a match is usable only up to the deepest position
every store there is holds what a resume needs (`peek`/`match` report that length).

The protocol's parts (prefix_cache.py) are small objects over the same tree and stores:
`memory` (`TreeMemory`), `waiting` (`TreeWaiting`) and `conversations` (conversations.py
`PromptMarks`). For KV alone
that is any whole page whose KV is on the device and not still being loaded; with snapshots, the
deepest node end holding one (stores/snapshots.py).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from radixserve.cache.admission import Admission, Verdict, Waiter
from radixserve.cache.conversations import PromptMarks
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import (CacheCounters, MatchResult, no_host_tier_stats,  # noqa: F401
                                           no_snapshot_stats)
from radixserve.cache.stores.device_kv import DeviceKV
from radixserve.cache.stores.host_kv import HostKV
from radixserve.cache.stores.snapshots import SnapshotStore
if TYPE_CHECKING:
    from radixserve.cache.disk_tier import StorageTier
from radixserve.cache.tree import (ALL, EMPTY_SLOTS, NAMESPACE, PARTIAL, PROMPT_END_SLACK,  # noqa: F401
                                   PageEventListener, RadixTree, TreeNode, slots_tensor)


class RadixCache:
    def __init__(self, allocator: PageAllocator, *, page_size: int = 1, eviction_policy: str = "lru",
                 host: Optional[HostKV] = None, states: Optional[SnapshotStore] = None):
        self.allocator = allocator
        self.page_size = page_size
        self.device = DeviceKV(allocator, page_size)
        self.host = host
        self.states = states
        # In the order each gives up what it holds of a node leaving the tree: the device last.
        stores = [s for s in (states, host) if s is not None] + [self.device]
        self.tree = RadixTree(page_size, eviction_policy, stores)
        self.device.tree = self.tree
        if host is not None:
            host.bind(self.tree, self.device, self.evict)
        if states is not None:
            states.bind(self.tree, host)
        self.copier = host.copier if host is not None else None
        self.keeps_prefixes = True
        self.counters = CacheCounters()
        self.memory = TreeMemory(self)
        self.waiting = TreeWaiting(self)
        self.conversations = PromptMarks(self.tree, page_size)

    # ------------------------------------------------------------------ the tree's figures
    @property
    def root(self) -> TreeNode:
        return self.tree.root

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def loading_tokens(self) -> int:
        return self.host.loading_tokens if self.host is not None else 0

    @property
    def host_size(self) -> int:
        return self.host.host_size if self.host is not None else 0

    @property
    def events(self) -> Optional[PageEventListener]:
        return self.tree.events

    @events.setter
    def events(self, listener: Optional[PageEventListener]) -> None:
        self.tree.events = listener

    def ready(self, node: TreeNode) -> bool:
        """Whether a node's KV can be read now: on the device, not waiting for a load."""
        return node.value is not None and (self.host is None or not self.host.loading(node))

    # ------------------------------------------------------------------ lookup
    def peek(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode]:
        """Usable length (page-aligned, on any tier) and the node it ends in; never changes the tree."""
        length, last, _ = self.waiting.peek_park(tokens, namespace=namespace)
        return length, last

    def host_part(self, length: int, node: TreeNode) -> tuple[int, bool]:
        """Of a peeked match: how many tokens are not on the device ready to read, and whether a
        load of some of them is in flight."""
        return self.host.host_part(length, node) if self.host is not None else (0, False)

    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None, kv_only: bool = False) -> MatchResult:
        """The longest usable cached prefix ready on the device; counts as an access for eviction.
        kv_only (or without snapshots): the longest whose KV is ready now, by the KV alone; the last
        node is split so the match ends at a node boundary."""
        if self.states is not None and not kv_only:
            return self.states.match(tokens, namespace)
        tree = self.tree
        tick = tree.next_tick()
        pieces: list[torch.Tensor] = []
        last, length = tree.namespace_root(namespace) or tree.root, 0
        for node, n, pos in tree.walk(tokens, namespace):
            if not self.ready(node):
                break
            if n < len(node.key):
                node = tree.split(node, n)
            node.last_access = tick
            node.hit_count += 1
            pieces.append(node.value)
            last, length = node, pos + n
        if last.lock_ref == 0 and tree.evictable_leaf(last):
            tree.push(last)  # its access time changed
        slots = torch.cat(pieces) if pieces else EMPTY_SLOTS
        return MatchResult(length, slots, last)

    # ------------------------------------------------------------------ admission
    def admit(self, waiter: Waiter, *, room: int, spare_only: bool) -> Admission:
        """Whether a waiting request may start now, or waits for a copy of its prefix from the host
        or storage tier (started here within `room` device tokens: the host store's policy,
        HostKV.admit; with host snapshots, of the snapshot it would resume from too,
        HostSnapshots.fetch); the Admission locks its prefix when it starts."""
        if self.host is None:
            return Admission(self, waiter)
        verdict, loading = self.host.admit(waiter, room, spare_only=spare_only, load=self.load)
        if self.states is not None and self.states.host is not None and self.states.host.fetch(waiter.peek_node):
            verdict = Verdict.WAITS
        return Admission(self, waiter, verdict, loading)

    @property
    def queued_saves(self) -> set[int]:
        return self.states.queued_saves if self.states is not None else set()

    # ------------------------------------------------------------------ what the page events read
    def on_reusable_path(self, node: TreeNode) -> bool:
        return self.states is None or self.states.on_reusable_path(node)

    def reusable_len(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> int:
        """How many leading tokens a match could still reach (every cached one, without snapshots)."""
        if self.states is not None:
            return self.states.reusable_len(tokens, namespace)
        return self.peek(tokens, namespace=namespace)[0]

    # ------------------------------------------------------------------ insert
    def insertable_len(self, computed: int) -> int:
        """A request's computed positions the tree takes: its whole pages."""
        return self.tree.page_floor(computed)

    def insert(self, tokens: Sequence[int], slots: Sequence[int] | torch.Tensor, *,
               namespace: Optional[str] = None) -> int:
        """Add tokens (whole pages) with their slots; returns how many leading tokens were already
        cached on the device. Slots may be a list: only the part the tree takes is converted (a
        finished request's prompt is mostly its cached prefix).

        The caller owns slots[:returned length] only where it did not get them from the tree: those
        are duplicates it must free. The tree takes ownership of slots[returned length:]; a node on
        the path held only by a lower tier takes the caller's slots (the caller computed those
        tokens itself), so the returned length is where the device copies end."""
        assert len(tokens) % self.page_size == 0 and len(tokens) == len(slots)
        tree = self.tree
        top = tree.namespace_root(namespace, create=bool(tokens))
        if top is None:
            return 0
        if self.host is not None:
            self.host.finish_loads_on(tokens, namespace)  # their slots must hold their KV before they count
        tick = tree.next_tick()
        node, pos, device_end = top, 0, 0
        for child, n, child_pos in tree.walk(tokens, namespace):
            if n < len(child.key):
                child = tree.split(child, n)
            child.last_access = tick
            if child.value is None:
                child.value = slots_tensor(slots, child_pos, child_pos + n)
                tree.gained_device(child)
                self.host.adopted(child)
                tree.push_if_evictable(child)
            else:
                device_end = child_pos + n
            node, pos = child, child_pos + n
        if pos < len(tokens):
            leaf = tree.add_leaf(node, list(tokens[pos:]), slots_tensor(slots, pos, len(tokens)), tick)
            self.counters.inserted_tokens += len(leaf.key)
            tree.touched.add((node, tree.child_key(tokens, pos)))
            # With snapshots, KV alone resumes nobody: a path becomes usable when a snapshot is hung on it.
            if self.states is None and tree.events is not None:
                tree.events.usable(leaf)
            if self.host is not None:
                self.host.inserted(leaf)
        elif node is not tree.root and tree.evictable_leaf(node) and node.lock_ref == 0:
            tree.push(node)  # its access time changed
        return device_end

    # ------------------------------------------------------------------ locking
    def lock(self, node: TreeNode) -> None:
        """Hold the path to node: a running request reads it."""
        self.tree.inc_lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.dec_lock(node)

    # ------------------------------------------------------------------ memory
    def evict(self, num_tokens: int) -> int:
        """Free device slots of unlocked leaves in policy order until num_tokens are freed (or nothing
        is left): with a host tier each keeps a host copy, else it leaves the tree."""
        if self.host is not None:
            freed = self.host.evict_device(num_tokens)
        else:
            freed = 0
            while freed < num_tokens:
                entry = self.tree.pop_evictable()
                if entry is None:
                    break
                freed += self.tree.remove_leaf(entry[1])
        self.counters.evicted_tokens += freed
        return freed

    def load(self, tokens: Sequence[int], *, spare_only: bool, namespace: Optional[str] = None) -> int:
        """Start copying the host part of tokens' cached prefix back to the device (with snapshots,
        only up to the deepest one); the tokens now loading (0: none, or no room)."""
        if self.host is None:
            return 0
        if self.states is not None:
            usable = self.states.loadable_len(tokens, namespace)
            if not usable:
                return 0
            tokens = tokens[:usable]
        return self.host.load(tokens, spare_only=spare_only, namespace=namespace)

    @property
    def storage(self) -> Optional[StorageTier]:
        """The storage tier under the host tier (disk_tier.StorageTier), or None."""
        return self.host.storage if self.host is not None else None

    def flush(self) -> bool:
        """Drop the whole tree and free what it holds; refused (False) while any request holds a lock."""
        if self.host is not None:
            self.host.copier.wait_all()
            self.waiting.poll()  # finished loads unlock their nodes
        tree = self.tree
        if tree.protected_size:
            return False
        for node in tree.iter_nodes():
            if node is not tree.root:
                for store in tree.stores:
                    store.on_flush(node)
                node.removed = True
                tree.touched.add((node, ALL))
        tree.touched.add((tree.root, ALL))
        tree.reset()
        for store in tree.stores:
            store.reset()
        if tree.events is not None:
            tree.events.cleared()
        return True

    # ------------------------------------------------------------------ bookkeeping
    def reset_counters(self) -> None:
        self.counters = CacheCounters()
        for store in self.tree.stores:
            store.reset_counters()

    def tier_stats(self) -> dict[str, float]:
        return self.host.stats() if self.host is not None else no_host_tier_stats()

    def snapshot_stats(self) -> dict[str, float]:
        return self.states.stats() if self.states is not None else no_snapshot_stats()


class TreeMemory:
    """RadixCache.memory: the tree's counters of the device tokens it holds, and every store's check."""

    def __init__(self, cache: RadixCache):
        self.cache = cache
        self.tree = cache.tree

    @property
    def evictable(self) -> int:
        return self.tree.evictable_size

    @property
    def protected(self) -> int:
        return self.tree.protected_size

    @property
    def reclaimable(self) -> int:
        return self.tree.reclaimable_size

    @property
    def waited(self) -> int:
        """Of the evictable tokens, those some waiting request will reuse."""
        return self.tree.waited_evictable_size

    def check(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
              running_rows: Sequence[int] = ()) -> None:
        """Every store's invariants: the device pool's sizes add up, no slot of any pool is owned twice."""
        cache = self.cache
        for store in (cache.device, cache.host, cache.states):
            if store is not None:
                store.check(held_by_running, running_slots, running_rows)


class TreeWaiting:
    """RadixCache.waiting: waiting requests park at the tree's nodes; their copies come from the
    host store (and the storage tier under it)."""

    def __init__(self, cache: RadixCache):
        self.cache = cache
        self.tree = cache.tree

    @property
    def root(self) -> TreeNode:
        return self.tree.root

    def peek_park(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode, object]:
        """Like RadixCache.peek, plus the park key: which change under that node could lengthen this match."""
        cache = self.cache
        if cache.states is not None:
            return cache.states.peek_park(tokens, namespace)
        tree = self.tree
        top = tree.namespace_root(namespace)
        if top is None:  # nothing cached in it yet: its first insert adds its root
            return 0, tree.root, (NAMESPACE, namespace)
        length, last, end = 0, top, 0
        for node, n, pos in tree.walk(tokens, namespace):
            length, last, end = pos + n, node, pos + len(node.key)
        if length < end:
            return length, last, PARTIAL
        if length + cache.page_size > len(tokens):
            return length, last, PARTIAL  # nothing left to match: no insert can lengthen it
        return length, last, tree.child_key(tokens, length)

    def add_waiter(self, node: TreeNode) -> None:
        self.tree.count_waiter(node, +1)

    def remove_waiter(self, node: TreeNode) -> None:
        self.tree.count_waiter(node, -1)

    def admit_ahead(self, arrivals: deque[Waiter], room: int) -> int:
        """Start the copies newly arrived requests will wait for (`admit`, taking only memory no
        waiting request needs), oldest first, up to a quarter of the device pool in flight; a
        request is dropped from `arrivals` once looked at, unless its copy found no room (the next
        step tries again). Returns the device tokens the copies started here take of `room`."""
        cache = self.cache
        host = cache.host
        if host is None:
            arrivals.clear()  # nothing is ever copied in: none has anything to wait for
            return 0
        cap = max(cache.allocator.total_tokens // 4, cache.page_size)
        taken = 0
        while arrivals and host.loading_tokens < cap:
            waiter = arrivals[0]
            if waiter.peek_node is not None:  # still waiting (parked in the queue)
                admission = cache.admit(waiter, room=room - taken, spare_only=True)
                if admission.verdict is Verdict.NO_ROOM:
                    return taken
                taken += admission.loading
            arrivals.popleft()
        return taken

    def poll(self) -> bool:
        """The start of a step's scheduling: states taken by the launched steps are copied out, and
        finished host-tier copies (and the storage tier's reads) taken in; True when a load finished."""
        cache = self.cache
        if cache.states is not None:
            cache.states.issue()
        host = cache.host
        if host is None:
            return False
        read = host.storage is not None and host.storage.poll()
        return host.take_in_copies() or read

    def drain_touched(self) -> set[tuple[TreeNode, object]]:
        tree = self.tree
        touched, tree.touched = tree.touched, set()
        return touched

    def iter_nodes(self) -> Iterator[TreeNode]:
        return self.tree.iter_nodes()
