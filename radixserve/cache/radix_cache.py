"""The prefix cache: one radix tree (`tree.py`) and the stores beside it (`stores/`).

Every cache the server builds is this class; what differs is which stores it has
(`factory.tree_cache` chooses): always the device KV (`stores.device_kv`); a host tier under it
(`stores.host_kv`: a prefix evicted from the device is copied to the host and loaded back); a
hybrid model's recurrent-state snapshots (`stores.snapshots`, with their own host tier,
`stores.host_snapshots`). Without a store, what it would do is not done: with no host tier the
protocol's host operations (`host_part`, `load`, `poll`) find nothing to do; with no snapshot
store every position of the KV is usable and a request keeps no state.

What a cache holds is usable per position: a match is usable only up to the deepest position
every store there is holds what a resume needs (`peek`/`match` report that length). For KV alone
that is any whole page whose KV is on the device and not still being loaded; with snapshots, the
deepest node end holding one (stores/snapshots.py).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from radixserve.cache.admission import Admission, Verdict, Waiter
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

    # ------------------------------------------------------------------ the tree's figures
    @property
    def root(self) -> TreeNode:
        return self.tree.root

    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size

    @property
    def protected_size(self) -> int:
        return self.tree.protected_size

    @property
    def waited_evictable_size(self) -> int:
        return self.tree.waited_evictable_size

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

    @property
    def reclaimable_size(self) -> int:
        """Evictable tokens no waiting request will reuse: what admission may take without cost."""
        return self.tree.reclaimable_size

    def ready(self, node: TreeNode) -> bool:
        """Whether a node's KV can be read now: on the device, not waiting for a load."""
        return node.value is not None and (self.host is None or not self.host.loading(node))

    # ------------------------------------------------------------------ lookup
    def peek(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode]:
        """Usable length (page-aligned, on any tier) and the node it ends in; never changes the tree."""
        length, last, _ = self.peek_park(tokens, namespace=namespace)
        return length, last

    def peek_park(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode, object]:
        """Like peek, plus the park key: which change under that node could lengthen this match."""
        if self.states is not None:
            return self.states.peek_park(tokens, namespace)
        tree = self.tree
        top = tree.namespace_root(namespace)
        if top is None:  # nothing cached in it yet: its first insert adds its root
            return 0, tree.root, (NAMESPACE, namespace)
        length, last, end = 0, top, 0
        for node, n, pos in tree.walk(tokens, namespace):
            length, last, end = pos + n, node, pos + len(node.key)
        if length < end:
            return length, last, PARTIAL
        if length + self.page_size > len(tokens):
            return length, last, PARTIAL  # nothing left to match: no insert can lengthen it
        return length, last, tree.child_key(tokens, length)

    def host_part(self, length: int, node: TreeNode) -> tuple[int, bool]:
        """Of a peeked match: how many tokens are not on the device ready to read, and whether a
        load of some of them is in flight."""
        return self.host.host_part(length, node) if self.host is not None else (0, False)

    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> MatchResult:
        """The longest usable cached prefix ready on the device; counts as an access for eviction."""
        if self.states is not None:
            return self.states.match(tokens, namespace)
        return self.match_kv(tokens, namespace=namespace)

    def match_kv(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> MatchResult:
        """Longest cached prefix whose KV is ready now, by the KV alone; splits the last node so the
        match ends at a node boundary."""
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

    def admit_ahead(self, arrivals: deque[Waiter], room: int) -> int:
        """Start the copies newly arrived requests will wait for (`admit`, taking only memory no
        waiting request needs), oldest first, up to a quarter of the device pool in flight; a
        request is dropped from `arrivals` once looked at, unless its copy found no room (the next
        step tries again). Returns the device tokens the copies started here take of `room`."""
        if self.host is None:
            arrivals.clear()  # nothing is ever copied in: none has anything to wait for
            return 0
        cap = max(self.allocator.total_tokens // 4, self.page_size)
        taken = 0
        while arrivals and self.host.loading_tokens < cap:
            waiter = arrivals[0]
            if waiter.peek_node is not None:  # still waiting (parked in the queue)
                admission = self.admit(waiter, room=room - taken, spare_only=True)
                if admission.verdict is Verdict.NO_ROOM:
                    return taken
                taken += admission.loading
            arrivals.popleft()
        return taken

    @property
    def queued_saves(self) -> set[int]:
        return self.states.queued_saves if self.states is not None else set()

    def on_reusable_path(self, node: TreeNode) -> bool:
        return self.states is None or self.states.on_reusable_path(node)

    def reusable_len(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> int:
        """How many leading tokens a match could still reach (every cached one, without snapshots)."""
        if self.states is not None:
            return self.states.reusable_len(tokens, namespace)
        return self.peek(tokens, namespace=namespace)[0]

    # ------------------------------------------------------------------ conversations
    def extends_a_prompt(self, node: TreeNode, uncached: Optional[int] = None) -> bool:
        """Whether the path to node (a request's match, split to end there) runs through the end of
        a finished request's prompt, or stops at most PROMPT_END_SLACK tokens (a page) short of
        one that the request goes past (`uncached`: its prompt tokens after the match; None: it
        does): the request continues that request's conversation. A client sending text
        re-tokenizes the previous prompt's last token together with the reply after it, so the
        next turn's match usually ends a token before the mark; the same prompt sent again (a
        retry, a health probe) ends there too, and continues nothing."""
        root = self.tree.root
        if node is root or node.namespace is not None:  # nothing matched
            return False
        # Such a match split the prompt's last node where it stopped: the marked rest is a child
        # (usually the only one). A node with many children is where prompts branch; not scanned.
        if len(node.children) <= 4:
            slack = max(PROMPT_END_SLACK, self.page_size)
            if uncached is not None:
                slack = min(slack, uncached - 1)
            if any(child.ends_prompt and len(child.key) <= slack for child in node.children.values()):
                return True
        while node is not root:
            if node.ends_prompt:
                return True
            node = node.parent
        return False

    def mark_prompt_end(self, prompt: Sequence[int], beyond: int, locked: Optional[tuple[TreeNode, int]] = None, *,
                        namespace: Optional[str] = None) -> None:
        """Mark the node boundary at the end of a finished request's prompt (whole pages; split
        there if needed), when that end lies beyond `beyond` tokens (what the request found
        cached: a prompt that only repeats a shared prefix marks nothing) and is still cached.
        locked: the node the request held and its path's length; when that is the prompt's end
        (its prompt went into the tree when computed), the node is marked without a walk."""
        end = self.tree.page_floor(len(prompt))
        if end <= beyond:
            return
        if locked is not None and locked[1] == end and locked[0] is not self.tree.root:
            locked[0].ends_prompt = True
            return
        for node, n, pos in self.tree.walk(prompt[:end], namespace):
            if pos + n == end:
                (node if n == len(node.key) else self.tree.split(node, n)).ends_prompt = True

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

    # ------------------------------------------------------------------ locking and waiting
    def inc_lock(self, node: TreeNode) -> None:
        """Hold the path to node: a running request reads it."""
        self.tree.inc_lock(node)

    def dec_lock(self, node: TreeNode) -> None:
        self.tree.dec_lock(node)

    def add_waiter(self, node: TreeNode) -> None:
        """A waiting request will reuse the path to node: evict it only when nothing else is left."""
        self.tree.count_waiter(node, +1)

    def remove_waiter(self, node: TreeNode) -> None:
        self.tree.count_waiter(node, -1)

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

    def poll(self) -> bool:
        """The start of a step's scheduling: states taken by the launched steps are copied out, and
        finished host-tier copies (and the storage tier's reads) taken in; True when a load finished."""
        if self.states is not None:
            self.states.issue()
        if self.host is None:
            return False
        read = self.host.storage is not None and self.host.storage.poll()
        return self.host.take_in_copies() or read

    @property
    def storage(self) -> Optional[StorageTier]:
        """The storage tier under the host tier (disk_tier.StorageTier), or None."""
        return self.host.storage if self.host is not None else None

    def flush(self) -> bool:
        """Drop the whole tree and free what it holds; refused (False) while any request holds a lock."""
        if self.host is not None:
            self.host.copier.wait_all()
            self.poll()  # finished loads unlock their nodes
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

    def drain_touched(self) -> set[tuple[TreeNode, object]]:
        tree = self.tree
        touched, tree.touched = tree.touched, set()
        return touched

    def iter_nodes(self) -> Iterator[TreeNode]:
        return self.tree.iter_nodes()

    def tier_stats(self) -> dict[str, float]:
        return self.host.stats() if self.host is not None else no_host_tier_stats()

    def snapshot_stats(self) -> dict[str, float]:
        return self.states.stats() if self.states is not None else no_snapshot_stats()

    def check_invariants(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
                         running_rows: Sequence[int] = ()) -> None:
        """Every store's invariants: the device pool's sizes add up, no slot of any pool is owned twice."""
        for store in (self.device, self.host, self.states):
            if store is not None:
                store.check(held_by_running, running_slots, running_rows)
