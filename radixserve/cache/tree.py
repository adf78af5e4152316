"""The radix tree of cached token prefixes: nodes, namespaces, locks, waiters, splits and the
eviction order of the device part of the tree. What a node holds lives in the stores beside the
tree (`radixserve.cache.stores`): its device KV slots, its host copy, its recurrent-state
snapshot. The tree only shapes them: it tells every store when a node is split or leaves, and asks
each store what it adds to a node's eviction priority.

Each node holds a run of tokens (a whole number of pages). Running requests lock the path to the
node their prefix ends in; waiting requests count on the path they will match (queue-aware
eviction). The device part of the tree (nodes with device KV, `TreeNode.value`) hangs from the
root; its unlocked leaves are evictable, in the order of the eviction policy, from a heap that is
never rebuilt by a full tree scan per eviction. Sizes are counters over the device tokens, so
`free + evictable + protected + held == total` can be checked at any time.

Cache namespaces (requests' cache salts): each has its own root, a child of the tree's root with
no tokens that is never evicted (it goes when nothing in it is left, held or waited for), so a
walk in one namespace never reaches another's nodes.

The tree also says what changed to the two things that follow it: `touched` (the waiting
queue's parked lookups) and `events`, the one page-event listener (`page_events.PageEvents`, which
feeds both `/kv_events` and the vLLM-format publisher).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch

from radixserve.cache.kv_pool import int64_tensor
from radixserve.cache.namespace import namespace_page_parent
from radixserve.cache.prefix import common_prefix_len

# Park keys: a lookup that ends inside a node waits on PARTIAL (a split can lengthen it); one that
# ends at a node's end waits on the child key of its next token; ALL marks a removed node.
PARTIAL = "partial"
ALL = "all"
# A namespace's root is the tree root's child under (NAMESPACE, namespace): a key no token or page
# of tokens is equal to. A lookup in a namespace that has no root yet parks on that key.
NAMESPACE = "namespace"
# The tiers a node's KV can be on, as KV-event consumers name them (vLLM's `medium`).
GPU = "GPU"
CPU = "CPU"

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)
# How far short of a finished prompt's end a match may stop and still count as its continuation
# (Conversations.extends_a_prompt); a snapshot store's prompt-end snapshot lies this far before it too.
PROMPT_END_SLACK = 8



class TreeNode:
    """A run of cached tokens (a whole number of pages): a node of the radix tree, and the handle
    a match, a lock and a waiting request hold. Besides its place in the tree it keeps one payload
    per store, in the field the store names: `value` (device KV slots, `stores.device_kv`), `host`
    (its host copy, `stores.host_kv`), `state` (a recurrent-state snapshot, `stores.snapshots`);
    None where that store holds nothing of it. A new store adds its field here."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "waiters", "last_access", "hit_count",
                 "created", "node_id", "removed", "ends_prompt", "block_hash", "namespace", "host", "state")

    def __init__(self, key: list[int], value: Optional[torch.Tensor], parent: Optional["TreeNode"], tick: int,
                 node_id: int):
        self.key = key
        self.value = value  # int64 device slots, len(value) == len(key); None: not on the device
        self.children: dict = {}
        self.parent = parent
        self.lock_ref = 0
        self.waiters = 0  # waiting requests whose cached match runs through this node
        self.last_access = tick
        self.hit_count = 0
        self.created = tick
        self.node_id = node_id
        self.removed = False
        # A finished request's prompt ended exactly here (`mark_prompt_end`); a split keeps it on the
        # lower part, which still ends there.
        self.ends_prompt = False
        # The chained hash of the node's last page (`block_hash.page_hashes`), memoised by the page
        # events and the storage tier (None: not computed). A split keeps the lower part's end, so
        # it stays true for the node's whole life.
        self.block_hash: Optional[int] = None
        # Set on a namespace's root only (no tokens, never evicted): the namespace it holds.
        self.namespace: Optional[str] = None
        self.host = None  # the host store's payload (stores/host_kv.py)
        self.state = None  # the snapshot store's payload (stores/snapshots.py)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __lt__(self, other: "TreeNode") -> bool:  # heap ties
        return self.node_id < other.node_id

    def __repr__(self) -> str:
        return f"TreeNode(id={self.node_id}, len={len(self.key)}, lock={self.lock_ref})"


class PageEventListener(Protocol):
    """What the tree and its stores tell of every change to what the cache holds, each once
    (`page_events.PageEvents` records them for `/kv_events` and the vLLM-format publisher)."""

    def stored(self, medium: str, node: TreeNode) -> None:
        """node's pages got their KV on the tier `medium` (GPU, CPU)."""

    def removed(self, medium: str, node: TreeNode) -> None:
        """node's pages are losing their KV on that tier (node is still in its place)."""

    def usable(self, node: TreeNode) -> None:
        """A match can end at node now: its path became reusable."""

    def unusable(self, node: TreeNode) -> None:
        """node's path may have stopped being reusable (node leaves the tree, or its last
        snapshot went); node is still in its place."""

    def cleared(self) -> None:
        """The whole cache was dropped."""


class Store(Protocol):
    """What the tree asks of each store beside it (stores/__init__.py says what each hook means)."""
    ranks_eviction: bool

    def on_split(self, upper: TreeNode, lower: TreeNode, n: int) -> None: ...

    def on_remove(self, node: TreeNode) -> None: ...

    def after_remove(self, node: TreeNode, parent: TreeNode) -> None: ...

    def on_flush(self, node: TreeNode) -> None: ...

    def leaves_device(self, node: TreeNode) -> None: ...

    def eviction_rank(self, node: TreeNode) -> tuple: ...

    def reset(self) -> None: ...

    def reset_counters(self) -> None: ...

    def check(self, held_by_running: int, running_slots: Sequence[torch.Tensor],
              running_rows: Sequence[int]) -> None: ...


EVICTION_KEYS: dict[str, Callable[[TreeNode], tuple]] = {
    "lru": lambda n: (n.last_access,),
    "lfu": lambda n: (n.hit_count, n.last_access),
    "fifo": lambda n: (n.created,),
}


def slots_tensor(slots: Sequence[int] | torch.Tensor, start: int, end: int) -> torch.Tensor:
    """slots[start:end] as a tensor the tree owns (a copy of a tensor's slice; a list converted)."""
    return slots[start:end].clone() if isinstance(slots, torch.Tensor) else int64_tensor(slots[start:end])


class RadixTree:
    """The tree, its device-token counters and its eviction order; `stores` shape what each node
    holds (every store is told of a split and of a node leaving, in list order)."""

    def __init__(self, page_size: int, eviction_policy: str, stores: Sequence[Store]):
        if eviction_policy not in EVICTION_KEYS:
            raise ValueError(f"unknown eviction policy {eviction_policy!r}; use one of {sorted(EVICTION_KEYS)}")
        self.page_size = page_size
        self.stores = list(stores)
        # The stores that rank device leaves beyond queue-awareness (a snapshot store: leaves
        # without a snapshot go first).
        self._ranking = [s for s in self.stores if s.ranks_eviction]
        self._policy_key = EVICTION_KEYS[eviction_policy]
        self._ids = itertools.count()
        self._tick = 0
        # (node, park key) pairs whose lookups may have changed; drained by the scheduler's queue.
        self.touched: set[tuple[TreeNode, object]] = set()
        self.events: Optional[PageEventListener] = None
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], EMPTY_SLOTS, None, 0, next(self._ids))
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.waited_evictable_size = 0  # of evictable_size, tokens some waiting request will reuse
        self.num_nodes = 1
        self._heap: list[tuple[tuple, TreeNode]] = []

    def next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def new_node(self, key: list[int], value: Optional[torch.Tensor], parent: Optional[TreeNode],
                 tick: int) -> TreeNode:
        return TreeNode(key, value, parent, tick, next(self._ids))

    def child_key(self, tokens: Sequence[int], pos: int):
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos:pos + self.page_size])

    def page_floor(self, n: int) -> int:
        return n - n % self.page_size

    # ------------------------------------------------------------------ namespaces
    def namespace_root(self, namespace: Optional[str], *, create: bool = False) -> Optional[TreeNode]:
        """Where a namespace's prefixes hang (the root for the shared one); None when it has none yet
        and create is False."""
        if namespace is None:
            return self.root
        node = self.root.children.get((NAMESPACE, namespace))
        if node is None and create:
            node = self.new_node([], EMPTY_SLOTS, self.root, self._tick)
            node.lock_ref = 1  # like the root: never evicted (it goes with its last node, see below)
            node.namespace = namespace
            node.block_hash = namespace_page_parent(namespace)  # its pages' KV-event hashes chain from it
            self.root.children[(NAMESPACE, namespace)] = node
            self.num_nodes += 1
            self.touched.add((self.root, (NAMESPACE, namespace)))  # lookups parked before it existed
        return node

    def drop_namespace_if_empty(self, node: TreeNode) -> None:
        """A namespace root nothing is cached in, held under or waited on leaves the tree (else
        every salt ever seen would keep a node)."""
        if node.namespace is not None and not node.children and node.lock_ref == 1 and not node.waiters \
                and not node.removed:
            del self.root.children[(NAMESPACE, node.namespace)]
            node.removed = True
            self.num_nodes -= 1
            self.touched.add((node, ALL))

    def namespace_of(self, node: TreeNode) -> Optional[str]:
        while node.parent is not None and node.parent is not self.root:
            node = node.parent
        return node.namespace

    # ------------------------------------------------------------------ walking
    def walk(self, tokens: Sequence[int], namespace: Optional[str] = None) -> Iterator[tuple[TreeNode, int, int]]:
        """Yield (node, matched tokens within node, position before node) along the match path."""
        node, pos = self.namespace_root(namespace), 0
        if node is None:
            return
        end = self.page_floor(len(tokens))
        while pos < end:
            child = node.children.get(self.child_key(tokens, pos))
            if child is None:
                return
            n = self.page_floor(common_prefix_len(child.key, tokens[pos:pos + len(child.key)]))
            n = min(n, end - pos)
            if n == 0:
                return
            partial = n < len(child.key)  # decided before the caller may split child
            yield child, n, pos
            if partial:
                return
            node, pos = child, pos + n

    def node_ending_at(self, tokens: Sequence[int], position: int, namespace: Optional[str]) -> Optional[TreeNode]:
        """The node whose path is tokens[:position] (split there if it ends inside one); None when
        the tree does not hold them."""
        for node, n, pos in self.walk(tokens[:position], namespace):
            if pos + n == position:
                return node if n == len(node.key) else self.split(node, n)
        return None

    def path_tokens(self, node: TreeNode) -> list[int]:
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return [t for key in reversed(keys) for t in key]

    def iter_nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ shape
    def split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut node after n tokens; returns the new upper part. Every store splits its payload (keys
        and slots are copied, not viewed); what lies at the node's end stays with the lower part."""
        parent = node.parent
        assert parent is not None
        upper = self.new_node(node.key[:n], None, parent, node.created)
        upper.lock_ref, upper.last_access, upper.hit_count = node.lock_ref, node.last_access, node.hit_count
        upper.waiters = node.waiters
        for store in self.stores:
            store.on_split(upper, node, n)
        parent.children[self.child_key(node.key, 0)] = upper
        node.key = node.key[n:]
        node.parent = upper
        upper.children[self.child_key(node.key, 0)] = node
        self.num_nodes += 1
        self.touched.add((node, PARTIAL))
        return upper

    def add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, tick: int) -> TreeNode:
        """A new evictable device leaf under parent."""
        leaf = self.new_node(key, value, parent, tick)
        parent.children[self.child_key(key, 0)] = leaf
        self.num_nodes += 1
        self.evictable_size += len(leaf.key)
        self.push(leaf)
        if self.events is not None:
            self.events.stored(GPU, leaf)
        return leaf

    def remove_leaf(self, node: TreeNode) -> int:
        """Take a childless, unlocked node out of the tree: every store gives up what it holds of it
        (in list order, the device store last), and its parent is offered for eviction once it is a
        device leaf. Returns the node's tokens."""
        if self.events is not None:
            self.events.unusable(node)
        for store in self.stores:
            store.on_remove(node)
        parent = node.parent
        del parent.children[self.child_key(node.key, 0)]
        node.removed = True
        self.num_nodes -= 1
        self.touched.add((node, ALL))
        if parent is not self.root and parent.value is not None and parent.lock_ref == 0 \
                and self.evictable_leaf(parent):
            self.push(parent)
        elif parent.namespace is not None:
            self.drop_namespace_if_empty(parent)
        for store in self.stores:
            store.after_remove(node, parent)
        return len(node.key)

    # ------------------------------------------------------------------ the device part
    def gained_device(self, node: TreeNode) -> None:
        """node (unlocked) just got device slots: count them as evictable."""
        if self.events is not None:
            self.events.stored(GPU, node)
        self.evictable_size += len(node.key)
        if node.waiters:
            self.waited_evictable_size += len(node.key)

    def lost_device(self, node: TreeNode) -> None:
        """An unlocked node's device slots are about to be freed: they count no more."""
        if self.events is not None:
            self.events.removed(GPU, node)
        self.evictable_size -= len(node.key)
        if node.waiters:
            self.waited_evictable_size -= len(node.key)

    @property
    def reclaimable_size(self) -> int:
        """Evictable tokens no waiting request will reuse: what admission may take without cost."""
        return self.evictable_size - self.waited_evictable_size

    def leave_device(self, node: TreeNode) -> None:
        """The device evicts node while a lower tier keeps it: every store lets go of what needs the
        device (the device store frees the slots last)."""
        for store in self.stores:
            store.leaves_device(node)

    def evictable_leaf(self, node: TreeNode) -> bool:
        """No child holds device slots, so evicting node keeps the device part of the tree a tree."""
        return not any(c.value is not None for c in node.children.values())

    # ------------------------------------------------------------------ locking
    def inc_lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                if node.waiters:
                    self.waited_evictable_size -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: TreeNode) -> None:
        top = node
        while node is not self.root:
            assert node.lock_ref > 0, f"unlock of unlocked {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                if node.waiters:
                    self.waited_evictable_size += len(node.key)
                if self.evictable_leaf(node):
                    self.push(node)
            top, node = node, node.parent
        if top.namespace is not None:
            self.drop_namespace_if_empty(top)

    # ------------------------------------------------------------------ waiting requests
    def count_waiter(self, node: TreeNode, delta: int) -> None:
        # Walk by parent links, not up to self.root: a node evicted or flushed since the request
        # was parked still leads up its old path, whose counts this undoes.
        top = node
        while node.parent is not None:
            node.waiters += delta
            assert node.waiters >= 0, f"waiter count of {node} went negative"
            if node.waiters == max(delta, 0) and node.lock_ref == 0 and not node.removed and node.value is not None:
                self.waited_evictable_size += delta * len(node.key)
                if self.evictable_leaf(node):
                    self.push(node)  # it just changed eviction class
            top, node = node, node.parent
        if delta < 0 and top.namespace is not None:
            self.drop_namespace_if_empty(top)

    # ------------------------------------------------------------------ eviction order
    def priority(self, node: TreeNode) -> tuple:
        # Queue-aware: a prefix some waiting request will match goes after every prefix nobody waits for.
        prio: tuple = (node.waiters > 0,)
        for store in self._ranking:
            prio += store.eviction_rank(node)
        return prio + self._policy_key(node)

    def push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (self.priority(node), node))
        if len(self._heap) > 4 * self.num_nodes + 1024:
            self._heap = [e for e in self._heap if self.is_current(e)]
            heapq.heapify(self._heap)

    def push_if_evictable(self, node: TreeNode) -> None:
        """Offer node again: its eviction class or access time changed."""
        if node.lock_ref == 0 and self.evictable_leaf(node):
            self.push(node)

    def is_current(self, entry: tuple[tuple, TreeNode]) -> bool:
        prio, node = entry
        return (node.value is not None and not node.removed and self.evictable_leaf(node) and node.lock_ref == 0
                and node is not self.root and prio == self.priority(node))

    def pop_evictable(self) -> Optional[tuple[tuple, TreeNode]]:
        """The next unlocked device leaf in eviction order (its heap entry); None when none is left."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self.is_current(entry):
                return entry
        return None

    def repush(self, entries: Sequence[tuple[tuple, TreeNode]]) -> None:
        for entry in entries:
            heapq.heappush(self._heap, entry)
