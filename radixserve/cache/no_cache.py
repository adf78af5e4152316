"""The prefix cache that keeps nothing (`--disable-radix-cache`): every lookup finds no cached
token, `insertable_len` takes none of a request's computed KV, so a request keeps the slots of its
chunks itself and frees them all when it leaves. The tree is its root alone, so every waiting
request parks there and the KV events are a flush at most."""

from __future__ import annotations

from collections import deque
from typing import Iterator, Optional, Sequence

import torch

from radixserve.cache.admission import Admission, Waiter
from radixserve.cache.conversations import NoConversations
from radixserve.cache.kv_pool import PageAllocator, int64_tensor
from radixserve.cache.prefix_cache import (CacheCounters, MatchResult, check_slot_ownership, no_host_tier_stats,
                                           no_snapshot_stats)
from radixserve.cache.tree import ALL, PARTIAL, PageEventListener, TreeNode

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class NoPrefixCache:
    def __init__(self, allocator: PageAllocator, *, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode([], _EMPTY_SLOTS, None, 0, 0)
        self.root.lock_ref = 1
        self.counters = CacheCounters()
        self.num_nodes = 1
        self.copier = None
        self.states = None  # no request keeps a state beyond its KV here
        self.keeps_prefixes = False
        self.events: Optional[PageEventListener] = None
        self.memory = NoMemory(self)
        self.waiting = NoWaiting(self)
        self.conversations = NoConversations()

    # ------------------------------------------------------------------ lookups: nothing is cached
    def peek(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode]:
        return 0, self.root

    def admit(self, waiter: Waiter, *, room: int, spare_only: bool) -> Admission:
        return Admission(self, waiter)  # nothing cached: nothing to wait for

    def match(self, tokens: Sequence[int], *, namespace: Optional[str] = None, kv_only: bool = False) -> MatchResult:
        return MatchResult(0, _EMPTY_SLOTS, self.root)

    def lock(self, node: TreeNode) -> None:
        assert node is self.root, f"{node} is not a handle of this cache"

    def unlock(self, node: TreeNode) -> None:
        assert node is self.root, f"{node} is not a handle of this cache"

    # ------------------------------------------------------------------ giving KV back: none is kept
    def insertable_len(self, computed: int) -> int:
        return 0

    def insert(self, tokens: Sequence[int], slots: Sequence[int] | torch.Tensor, *,
               namespace: Optional[str] = None) -> int:
        """Takes the slots, as a cache would, and frees them at once: nothing was cached before."""
        assert len(tokens) == len(slots)
        if len(slots):
            self.allocator.free_slots(slots if isinstance(slots, torch.Tensor) else int64_tensor(slots))
        return 0

    # ------------------------------------------------------------------ memory
    def evict(self, num_tokens: int) -> int:
        return 0

    def flush(self) -> bool:
        """Nothing to drop; the event listener hears the flush all the same, as from a tree."""
        self.waiting.touched.add((self.root, ALL))
        if self.events is not None:
            self.events.cleared()
        return True

    # ------------------------------------------------------------------ bookkeeping
    def reset_counters(self) -> None:
        self.counters = CacheCounters()

    def on_reusable_path(self, node: TreeNode) -> bool:
        return node is self.root

    def reusable_len(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> int:
        return 0

    def tier_stats(self) -> dict[str, float]:
        return no_host_tier_stats()

    def snapshot_stats(self) -> dict[str, float]:
        return no_snapshot_stats()


class NoMemory:
    """NoPrefixCache.memory: it holds no token; running requests own every slot that is not free."""

    evictable = protected = reclaimable = waited = 0

    def __init__(self, cache: NoPrefixCache):
        self.cache = cache

    def check(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
              running_rows: Sequence[int] = ()) -> None:
        """Running requests own every slot that is not free."""
        cache = self.cache
        assert not cache.root.children and cache.root.waiters == 0, "the cache that keeps nothing holds something"
        total, free = cache.allocator.total_tokens, cache.allocator.free_tokens
        assert free + held_by_running == total, f"free {free} + held {held_by_running} != {total}"
        check_slot_ownership([cache.allocator.free_slot_tensor(), *running_slots], total, cache.page_size)


class NoWaiting:
    """NoPrefixCache.waiting: every waiting request parks at the root, where no change ever
    lengthens its match, and waits for no copy."""

    def __init__(self, cache: NoPrefixCache):
        self.root = cache.root
        self.touched: set[tuple[TreeNode, object]] = set()

    def peek_park(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode, object]:
        return 0, self.root, PARTIAL  # no change ever lengthens it

    def add_waiter(self, node: TreeNode) -> None:
        assert node is self.root, f"{node} is not a handle of this cache"

    def remove_waiter(self, node: TreeNode) -> None:
        assert node is self.root, f"{node} is not a handle of this cache"

    def admit_ahead(self, arrivals: deque[Waiter], room: int) -> int:
        arrivals.clear()
        return 0

    def poll(self) -> bool:
        return False

    def drain_touched(self) -> set[tuple[TreeNode, object]]:
        touched, self.touched = self.touched, set()
        return touched

    def iter_nodes(self) -> Iterator[TreeNode]:
        yield self.root
