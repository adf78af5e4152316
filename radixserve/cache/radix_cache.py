"""The radix tree of cached token prefixes and their KV slots: the device-only `PrefixCache`.

Each node holds a run of tokens (a whole number of pages) and the KV slot of each token.
Running requests lock the path to the node their prefix ends in; unlocked leaves are
evictable, in the order of the eviction policy, from a heap that is never rebuilt by a full
tree scan per eviction. Sizes are kept as counters so `free + evictable + protected + held ==
total` can be checked at any time. `TieredRadixCache` (tiered_cache.py) puts a host-memory tier
under this tree through the few hooks marked below; without it nothing here changes, and the
protocol's host-tier operations (`host_part`, `load`, `poll`) find nothing to do.

Cache namespaces (requests' cache salts): each has its own root, a child of the tree's root with
no tokens that is never evicted (it goes when nothing in it is left, held or waited for), so a
walk in one namespace never reaches another's nodes.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator, Optional, Sequence

import torch

from radixserve.cache.kv_pool import PageAllocator, int64_tensor
from radixserve.cache.prefix import common_prefix_len
from radixserve.cache.namespace import namespace_page_parent
from radixserve.cache.prefix_cache import (ALL, CPU, GPU, NAMESPACE, PARTIAL, BlockListener,  # noqa: F401
                                           CacheCounters, EventListener, MatchResult, TreeNode,
                                           check_slot_ownership, no_host_tier_stats, no_snapshot_stats)

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)
# How far short of a finished prompt's end a match may stop and still count as its continuation
# (see RadixCache.extends_a_prompt).
PROMPT_END_SLACK = 8


EVICTION_KEYS: dict[str, Callable[[TreeNode], tuple]] = {
    "lru": lambda n: (n.last_access,),
    "lfu": lambda n: (n.hit_count, n.last_access),
    "fifo": lambda n: (n.created,),
}


def slots_tensor(slots: Sequence[int] | torch.Tensor, start: int, end: int) -> torch.Tensor:
    """slots[start:end] as a tensor the tree owns (a copy of a tensor's slice; a list converted)."""
    return slots[start:end].clone() if isinstance(slots, torch.Tensor) else int64_tensor(slots[start:end])


class RadixCache:
    node_type: type[TreeNode] = TreeNode  # the host tier's nodes carry its fields too
    keeps_branch_states = False  # KV alone: a branch point needs nothing kept

    def __init__(self, allocator: PageAllocator, *, page_size: int = 1, eviction_policy: str = "lru"):
        if eviction_policy not in EVICTION_KEYS:
            raise ValueError(f"unknown eviction policy {eviction_policy!r}; use one of {sorted(EVICTION_KEYS)}")
        self.allocator = allocator
        self.page_size = page_size
        self.copier = None  # no host tier: nothing is copied
        self.loading_tokens = 0
        self.keeps_prefixes = True
        self._policy_key = EVICTION_KEYS[eviction_policy]
        self._ids = itertools.count()
        self._tick = 0
        self.counters = CacheCounters()
        # (node, park key) pairs whose lookups may have changed; drained by the scheduler's queue.
        self.touched: set[tuple[TreeNode, object]] = set()
        # Called with ("insert" | "evict", tokens from the namespace's root to the end of the node, the
        # namespace) or ("flush", [], None), so a router can mirror what this cache really holds.
        self.event_listener: Optional[EventListener] = None
        # Called with ("stored" | "removed", medium, node) whenever a node's pages gain or lose their
        # KV on a tier (medium "GPU": the device pool, "CPU": the host tier), and ("cleared", "", root)
        # on a flush: the per-tier view a cluster's KV-event consumers follow (`block_events`).
        self.block_listener: Optional[BlockListener] = None
        self._reset()

    # ------------------------------------------------------------------ basics
    def _reset(self) -> None:
        self.root = self.node_type([], _EMPTY_SLOTS, None, 0, next(self._ids))
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.waited_evictable_size = 0  # of evictable_size, tokens some waiting request will reuse
        self.num_nodes = 1
        self._heap: list[tuple[tuple, TreeNode]] = []

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _child_key(self, tokens: Sequence[int], pos: int):
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos:pos + self.page_size])

    def _page_floor(self, n: int) -> int:
        return n - n % self.page_size

    @property
    def total_cached(self) -> int:
        return self.evictable_size + self.protected_size

    # ------------------------------------------------------------------ namespaces
    def _namespace_root(self, namespace: Optional[str], *, create: bool = False) -> Optional[TreeNode]:
        """Where a namespace's prefixes hang (the root for the shared one); None when it has none yet
        and create is False."""
        if namespace is None:
            return self.root
        node = self.root.children.get((NAMESPACE, namespace))
        if node is None and create:
            node = self.node_type([], _EMPTY_SLOTS, self.root, self._tick, next(self._ids))
            node.lock_ref = 1  # like the root: never evicted (it goes with its last node, see below)
            node.namespace = namespace
            node.block_hash = namespace_page_parent(namespace)  # its pages' KV-event hashes chain from it
            self.root.children[(NAMESPACE, namespace)] = node
            self.num_nodes += 1
            self.touched.add((self.root, (NAMESPACE, namespace)))  # lookups parked before it existed
        return node

    def _drop_namespace_if_empty(self, node: TreeNode) -> None:
        """A namespace root nothing is cached in, held under or waited on leaves the tree (else
        every salt ever seen would keep a node)."""
        if node.namespace is not None and not node.children and node.lock_ref == 1 and not node.waiters \
                and not node.removed:
            del self.root.children[(NAMESPACE, node.namespace)]
            node.removed = True
            self.num_nodes -= 1
            self.touched.add((node, ALL))

    def _namespace_of(self, node: TreeNode) -> Optional[str]:
        while node.parent is not None and node.parent is not self.root:
            node = node.parent
        return node.namespace

    # ------------------------------------------------------------------ lookup
    def _walk(self, tokens: Sequence[int], namespace: Optional[str] = None) -> Iterator[tuple[TreeNode, int, int]]:
        """Yield (node, matched tokens within node, position before node) along the match path."""
        node, pos = self._namespace_root(namespace), 0
        if node is None:
            return
        end = self._page_floor(len(tokens))
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                return
            n = self._page_floor(common_prefix_len(child.key, tokens[pos:pos + len(child.key)]))
            n = min(n, end - pos)
            if n == 0:
                return
            partial = n < len(child.key)  # decided before the caller may split child
            yield child, n, pos
            if partial:
                return
            node, pos = child, pos + n

    def peek(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode]:
        """Matched length (page-aligned) and the deepest node touched; never changes the tree."""
        length, last, _ = self.peek_park(tokens, namespace=namespace)
        return length, last

    def peek_park(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode, object]:
        """Like peek, plus the park key: which change under that node could lengthen this match."""
        top = self._namespace_root(namespace)
        if top is None:  # nothing cached in it yet: its first insert adds its root
            return 0, self.root, (NAMESPACE, namespace)
        length, last, end = 0, top, 0
        for node, n, pos in self._walk(tokens, namespace):
            length, last, end = pos + n, node, pos + len(node.key)
        if length < end:
            return length, last, PARTIAL
        if length + self.page_size > len(tokens):
            return length, last, PARTIAL  # nothing left to match: no insert can lengthen it
        return length, last, self._child_key(tokens, length)

    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> MatchResult:
        """Longest cached prefix whose KV is usable now (`_ready`); splits the last node so the match
        ends at a node boundary."""
        tick = self._next_tick()
        pieces: list[torch.Tensor] = []
        last, length = self._namespace_root(namespace) or self.root, 0
        for node, n, pos in self._walk(tokens, namespace):
            if not self._ready(node):
                break
            if n < len(node.key):
                node = self._split(node, n)
            node.last_access = tick
            node.hit_count += 1
            pieces.append(node.value)
            last, length = node, pos + n
        if last.lock_ref == 0 and self._evictable_leaf(last):
            self._push(last)  # its access time changed
        slots = torch.cat(pieces) if pieces else _EMPTY_SLOTS
        return MatchResult(length, slots, last)

    def match_kv(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> MatchResult:
        """KV is the only state this tree keeps: its match."""
        return RadixCache.match(self, tokens, namespace=namespace)

    # ------------------------------------------------------------------ recurrent states (none here)
    # A tree of KV alone keeps no other state: a match needs nothing put into the request's row and
    # asks for no chunk end; SnapshotRadixCache (snapshot_cache.py) fills these in.
    def resume(self, row: int, match: MatchResult, *, branch_at: int = 0,
               hints: Sequence[int] = ()) -> tuple[int, ...]:
        return match.chunk_ends

    def resumed_from_host(self, row: int) -> bool:
        return False

    def cancel_resume(self, row: int) -> None:
        return None

    def take_state(self, row: int, position: int) -> None:
        return None

    def capture_states(self, row: int, start: int, end: int) -> list[tuple[int, int]]:
        return []

    def keep_states(self, row: int, tokens: Sequence[int], *, namespace: Optional[str] = None,
                    state_len: Optional[int] = None, readmitted: bool = False) -> None:
        return None

    def discard_states(self, rows: Sequence[int]) -> None:
        return None

    def snapshot_stats(self) -> dict[str, float]:
        return no_snapshot_stats()

    def on_reusable_path(self, node: TreeNode) -> bool:
        return True

    def reusable_len(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> int:
        """Every cached token can be matched: the peek."""
        return self.peek(tokens, namespace=namespace)[0]

    # ------------------------------------------------------------------ the host tier (none here)
    def host_part(self, length: int, node: TreeNode) -> tuple[int, bool]:
        """Every cached token is on the device, ready."""
        return 0, False

    def load(self, tokens: Sequence[int], *, spare_only: bool, namespace: Optional[str] = None) -> int:
        return 0

    def poll(self) -> bool:
        return False

    def fetch(self, key: str, tokens: Callable[[], Sequence[int]], matched: int, *,
              namespace: Optional[str] = None) -> bool:
        return False

    def tier_stats(self) -> dict[str, float]:
        return no_host_tier_stats()

    # ------------------------------------------------------------------ conversations
    def extends_a_prompt(self, node: TreeNode, uncached: Optional[int] = None) -> bool:
        """Whether the path to node (a request's match, split to end there) runs through the end of
        a finished request's prompt, or stops at most PROMPT_END_SLACK tokens (a page) short of
        one that the request goes past (`uncached`: its prompt tokens after the match; None: it
        does): the request continues that request's conversation. A client sending text
        re-tokenizes the previous prompt's last token together with the reply after it, so the
        next turn's match usually ends a token before the mark; the same prompt sent again (a
        retry, a health probe) ends there too, and continues nothing."""
        if node is self.root or node.namespace is not None:  # nothing matched
            return False
        # Such a match split the prompt's last node where it stopped: the marked rest is a child
        # (usually the only one). A node with many children is where prompts branch; not scanned.
        if len(node.children) <= 4:
            slack = max(PROMPT_END_SLACK, self.page_size)
            if uncached is not None:
                slack = min(slack, uncached - 1)
            if any(child.ends_prompt and len(child.key) <= slack for child in node.children.values()):
                return True
        while node is not self.root:
            if node.ends_prompt:
                return True
            node = node.parent
        return False

    # ------------------------------------------------------------------ mutation
    def mark_prompt_end(self, prompt: Sequence[int], beyond: int, locked: Optional[tuple[TreeNode, int]] = None, *,
                        namespace: Optional[str] = None) -> None:
        """Mark the node boundary at the end of a finished request's prompt (whole pages; split
        there if needed), when that end lies beyond `beyond` tokens (what the request found
        cached: a prompt that only repeats a shared prefix marks nothing) and is still cached.
        locked: the node the request held and its path's length; when that is the prompt's end
        (its prompt went into the tree when computed), the node is marked without a walk."""
        end = self._page_floor(len(prompt))
        if end <= beyond:
            return
        if locked is not None and locked[1] == end and locked[0] is not self.root:
            locked[0].ends_prompt = True
            return
        for node, n, pos in self._walk(prompt[:end], namespace):
            if pos + n == end:
                (node if n == len(node.key) else self._split(node, n)).ends_prompt = True

    def _ready(self, node: TreeNode) -> bool:
        """Whether a node's KV can be read now: always, with one tier."""
        return True

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut node after n tokens; returns the new upper part. Keys and values are copied, not viewed."""
        parent = node.parent
        assert parent is not None
        upper = self.node_type(node.key[:n], node.value[:n].clone(), parent, node.created, next(self._ids))
        upper.lock_ref, upper.last_access, upper.hit_count = node.lock_ref, node.last_access, node.hit_count
        upper.waiters, upper.snapshots_below = node.waiters, node.snapshots_below
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[n:]
        node.value = node.value[n:].clone()
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        self.num_nodes += 1
        self.touched.add((node, PARTIAL))
        return upper

    def insertable_len(self, computed: int) -> int:
        """A request's computed positions the tree takes: its whole pages."""
        return self._page_floor(computed)

    def insert(self, tokens: Sequence[int], slots: Sequence[int] | torch.Tensor, *,
               namespace: Optional[str] = None) -> int:
        """Add tokens (whole pages) with their slots; returns how many leading tokens were already cached.
        Slots may be a list: only the part the tree takes is converted (a finished request's
        prompt is mostly its cached prefix).

        The caller owns slots[:returned length] only where it did not get them from the tree: those
        are duplicates it must free. The tree takes ownership of slots[returned length:].
        """
        assert len(tokens) % self.page_size == 0 and len(tokens) == len(slots)
        top = self._namespace_root(namespace, create=bool(tokens))
        if top is None:
            return 0
        tick = self._next_tick()
        node, pos = top, 0
        for child, n, child_pos in self._walk(tokens, namespace):
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node, pos = child, child_pos + n
        if pos < len(tokens):
            self._add_leaf(node, tokens, pos, slots, tick, namespace)
        elif node is not self.root and self._evictable_leaf(node) and node.lock_ref == 0:
            self._push(node)  # its access time changed
        return pos

    def _add_leaf(self, parent: TreeNode, tokens: Sequence[int], pos: int, slots: Sequence[int] | torch.Tensor,
                  tick: int, namespace: Optional[str]) -> TreeNode:
        """tokens[pos:] as a new evictable leaf under parent, owning slots[pos:]."""
        leaf = self.node_type(list(tokens[pos:]), slots_tensor(slots, pos, len(tokens)), parent, tick, next(self._ids))
        parent.children[self._child_key(tokens, pos)] = leaf
        self.num_nodes += 1
        self.evictable_size += len(leaf.key)
        self.counters.inserted_tokens += len(leaf.key)
        self._push(leaf)
        self.touched.add((parent, self._child_key(tokens, pos)))
        self._publish_insert(tokens, namespace)
        if self.block_listener is not None:
            self.block_listener("stored", GPU, leaf)
        return leaf

    def _publish_insert(self, tokens: Sequence[int], namespace: Optional[str]) -> None:
        """Tell /kv_events that tokens can now be matched (SnapshotRadixCache says so only where a
        snapshot makes them usable)."""
        if self.event_listener is not None:
            self.event_listener("insert", list(tokens), namespace)

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
                if self._evictable_leaf(node):
                    self._push(node)
            top, node = node, node.parent
        if top.namespace is not None:
            self._drop_namespace_if_empty(top)

    # ------------------------------------------------------------------ waiting requests
    def add_waiter(self, node: TreeNode) -> None:
        """A waiting request will reuse the path to node: evict it only when nothing else is left."""
        self._count_waiter(node, +1)

    def remove_waiter(self, node: TreeNode) -> None:
        self._count_waiter(node, -1)

    def _count_waiter(self, node: TreeNode, delta: int) -> None:
        # Walk by parent links, not up to self.root: a node evicted or flushed since the request
        # was parked still leads up its old path, whose counts this undoes.
        top = node
        while node.parent is not None:
            node.waiters += delta
            assert node.waiters >= 0, f"waiter count of {node} went negative"
            if node.waiters == max(delta, 0) and node.lock_ref == 0 and not node.removed and self._on_device(node):
                self.waited_evictable_size += delta * len(node.key)
                if self._evictable_leaf(node):
                    self._push(node)  # it just changed eviction class
            top, node = node, node.parent
        if delta < 0 and top.namespace is not None:
            self._drop_namespace_if_empty(top)

    @property
    def reclaimable_size(self) -> int:
        """Evictable tokens no waiting request will reuse: what admission may take without cost."""
        return self.evictable_size - self.waited_evictable_size

    # ------------------------------------------------------------------ eviction
    # Tier hooks: every node of this tree is on the device; TieredRadixCache says otherwise.
    def _evictable_leaf(self, node: TreeNode) -> bool:
        """No child holds device slots, so evicting node keeps the device part of the tree a tree."""
        return not node.children

    def _on_device(self, node: TreeNode) -> bool:
        return True

    def _priority(self, node: TreeNode) -> tuple:
        # Queue-aware: a prefix some waiting request will match goes after every prefix nobody waits for.
        return (node.waiters > 0,) + self._policy_key(node)

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (self._priority(node), node))
        if len(self._heap) > 4 * self.num_nodes + 1024:
            self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [e for e in self._heap if self._is_current(e)]
        heapq.heapify(self._heap)

    def _is_current(self, entry: tuple[tuple, TreeNode]) -> bool:
        prio, node = entry
        return (not node.removed and self._evictable_leaf(node) and node.lock_ref == 0 and node is not self.root
                and prio == self._priority(node))

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves in policy order until num_tokens are freed (or nothing is left)."""
        freed = 0
        while freed < num_tokens and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._is_current(entry):
                continue
            freed += self._remove_leaf(entry[1])
        self.counters.evicted_tokens += freed
        return freed

    def _remove_leaf(self, node: TreeNode) -> int:
        """Take a childless, unlocked node out of the tree, freeing its device slots (if it has
        them); its parent is offered for eviction once it is a leaf. Returns the node's tokens."""
        if self.event_listener is not None:
            self.event_listener("evict", self._path_tokens(node), self._namespace_of(node))
        if node.value is not None:
            if self.block_listener is not None:
                self.block_listener("removed", GPU, node)
            self.evictable_size -= len(node.key)
            if node.waiters:
                self.waited_evictable_size -= len(node.key)
            self.allocator.free_slots(node.value)
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        node.removed = True
        self.num_nodes -= 1
        self.touched.add((node, ALL))
        if parent is not self.root and parent.value is not None and parent.lock_ref == 0 \
                and self._evictable_leaf(parent):
            self._push(parent)
        elif parent.namespace is not None:
            self._drop_namespace_if_empty(parent)
        return len(node.key)

    def flush(self) -> bool:
        """Drop the whole tree and free its slots; refused (False) while any request holds a lock."""
        if self.protected_size:
            return False
        for node in self.iter_nodes():
            if node is not self.root:
                self._free_node_slots(node)
                node.removed = True
                self.touched.add((node, ALL))
        self.touched.add((self.root, ALL))
        self._reset()
        if self.event_listener is not None:
            self.event_listener("flush", [], None)
        if self.block_listener is not None:
            self.block_listener("cleared", "", self.root)
        return True

    def _free_node_slots(self, node: TreeNode) -> None:
        """Give back what a node being dropped with the whole tree owns."""
        self.allocator.free_slots(node.value)

    def reset_counters(self) -> None:
        self.counters = CacheCounters()

    def drain_touched(self) -> set[tuple[TreeNode, object]]:
        touched, self.touched = self.touched, set()
        return touched

    def _path_tokens(self, node: TreeNode) -> list[int]:
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return [t for key in reversed(keys) for t in key]

    # ------------------------------------------------------------------ checks
    def iter_nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> list[torch.Tensor]:
        return [n.value for n in self.iter_nodes() if n is not self.root and self._on_device(n)]

    def check_invariants(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
                         running_rows: Sequence[int] = ()) -> None:
        """Sizes add up to the pool, no slot is owned twice, locks and pages are consistent."""
        evictable = protected = waited = 0
        for node in self.iter_nodes():
            if node is self.root:
                continue
            assert not node.removed, f"{node} is in the tree but marked removed"
            if node.namespace is not None:
                assert node.parent is self.root and self.root.children.get((NAMESPACE, node.namespace)) is node
                assert not node.key and node.lock_ref >= 1, f"{node}: a namespace root holds tokens or is unlocked"
                assert node.children or node.lock_ref > 1 or node.waiters, f"{node}: an empty namespace root is kept"
                continue
            assert len(node.key) % self.page_size == 0 and node.key, f"{node}: not whole pages"
            assert node.parent.children.get(self._child_key(node.key, 0)) is node, f"{node}: bad parent link"
            if node.parent is not self.root:
                assert node.parent.lock_ref >= node.lock_ref, f"{node}: locked more than its parent"
            if not self._on_device(node):
                continue  # a host-tier node: the tiered cache checks it
            assert len(node.key) == len(node.value), f"{node}: key/value length mismatch"
            if node.waiters and not node.lock_ref:
                waited += len(node.key)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self.evictable_size, f"evictable counter {self.evictable_size} != {evictable}"
        assert protected == self.protected_size, f"protected counter {self.protected_size} != {protected}"
        assert waited == self.waited_evictable_size, f"waited counter {self.waited_evictable_size} != {waited}"
        total = self.allocator.total_tokens
        free = self.allocator.free_tokens
        assert free + evictable + protected + held_by_running == total, (
            f"free {free} + evictable {evictable} + protected {protected} + held {held_by_running} != {total}")
        owned = self.all_slots() + [self.allocator.free_slot_tensor()] + list(running_slots)
        check_slot_ownership(owned, total, self.page_size)
