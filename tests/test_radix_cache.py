"""RadixCache against a brute-force reference, driven by random operation sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix import common_prefix_len
from radixserve.cache.radix_cache import RadixCache

TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=14)


class RadixCacheMachine(RuleBasedStateMachine):
    """The reference is a dict from every cached page-aligned prefix to the slots of its tokens."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def setup(self, page_size: int, policy: str) -> None:
        self.page = page_size
        self.alloc = PageAllocator(num_pages=64 // page_size, page_size=page_size)
        self.cache = RadixCache(self.alloc, page_size=page_size, eviction_policy=policy)
        self.ref: dict[tuple, list[int]] = {}
        self.locked: list = []

    def _aligned(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.page]

    def _ref_match(self, tokens: list[int]) -> tuple[int, list[int]]:
        tokens = self._aligned(tokens)
        for n in range(len(tokens), 0, -self.page):
            if tuple(tokens[:n]) in self.ref:
                return n, self.ref[tuple(tokens[:n])]
        return 0, []

    def _sync_after_eviction(self) -> None:
        """Evictions drop whole leaves: what is left must be a prefix-closed subset of the reference."""
        present: dict[tuple, list[int]] = {}
        stack = [((), [], self.cache.root)]
        while stack:
            prefix, slots, node = stack.pop()
            for child in node.children.values():
                for i in range(self.page, len(child.key) + 1, self.page):
                    key = prefix + tuple(child.key[:i])
                    present[key] = slots + child.value[:i].tolist()
                stack.append((prefix + tuple(child.key), slots + child.value.tolist(), child))
        for key, slots in present.items():
            assert self.ref.get(key) == slots, "the tree holds a prefix the reference never had"
        self.ref = present

    @rule(tokens=TOKENS)
    def insert(self, tokens: list[int]) -> None:
        tokens = self._aligned(tokens)
        pages = len(tokens) // self.page
        if pages > len(self.alloc._free_pages):
            self.cache.evict(pages * self.page)
            self._sync_after_eviction()
            if pages > len(self.alloc._free_pages):
                return
        slots = self.alloc.pages_to_slots(self.alloc.alloc_pages(pages)) if pages else torch.empty(0, dtype=torch.int64)
        expect_cached, _ = self._ref_match(tokens)
        already = self.cache.insert(tokens, slots)
        assert already == expect_cached
        self.alloc.free_slots(slots[:already])  # the caller's duplicates
        prev: list[int] = []
        for i in range(self.page, len(tokens) + 1, self.page):
            prev = self.ref.setdefault(tuple(tokens[:i]), prev + slots[i - self.page:i].tolist())

    @rule(tokens=TOKENS, lock=st.booleans())
    def match(self, tokens: list[int], lock: bool) -> None:
        peek_len, _ = self.cache.peek(tokens)
        result = self.cache.match(tokens)
        n, slots = self._ref_match(tokens)
        assert peek_len == result.length == n
        assert result.slots.tolist() == slots
        if lock and n:
            self.cache.inc_lock(result.last_node)
            self.locked.append((tokens[:n], result.last_node))

    @precondition(lambda self: self.locked)
    @rule(index=st.integers(0, 100))
    def unlock(self, index: int) -> None:
        _, node = self.locked.pop(index % len(self.locked))
        self.cache.dec_lock(node)

    @rule(n=st.integers(1, 40))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size
        freed = self.cache.evict(n)
        assert freed >= min(n, before) or self.cache.evictable_size == 0
        self._sync_after_eviction()
        for tokens, _ in self.locked:  # locked prefixes survive any eviction
            assert self.cache.peek(tokens)[0] == len(tokens)

    @precondition(lambda self: not self.locked)
    @rule()
    def flush(self) -> None:
        assert self.cache.flush()
        self.ref = {}
        assert self.alloc.free_tokens == self.alloc.total_tokens

    @invariant()
    def sizes_add_up(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()


RadixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_radix_cache_against_reference = RadixCacheMachine.TestCase


def test_flush_is_refused_while_locked() -> None:
    alloc = PageAllocator(16, 1)
    cache = RadixCache(alloc)
    slots = alloc.pages_to_slots(alloc.alloc_pages(4))
    cache.insert([1, 2, 3, 4], slots)
    m = cache.match([1, 2, 3, 4])
    cache.inc_lock(m.last_node)
    assert not cache.flush()
    cache.dec_lock(m.last_node)
    assert cache.flush()
    cache.check_invariants()


def test_split_copies_and_does_not_share_views() -> None:
    alloc = PageAllocator(16, 1)
    cache = RadixCache(alloc)
    slots = alloc.pages_to_slots(alloc.alloc_pages(6))
    cache.insert([1, 2, 3, 4, 5, 6], slots)
    m = cache.match([1, 2, 3, 9])
    assert m.length == 3
    lower = next(iter(m.last_node.children.values()))
    assert m.last_node.value.data_ptr() != lower.value.data_ptr()
    assert m.last_node.value.untyped_storage().data_ptr() != lower.value.untyped_storage().data_ptr()


@pytest.mark.parametrize("policy,expect_left", [("lru", [1, 1]), ("fifo", [2, 2]), ("lfu", [1, 1])])
def test_eviction_order_follows_policy(policy: str, expect_left: list[int]) -> None:
    alloc = PageAllocator(16, 1)
    cache = RadixCache(alloc, eviction_policy=policy)
    for first in (1, 2):
        slots = alloc.pages_to_slots(alloc.alloc_pages(2))
        cache.insert([first, first], slots)
    cache.match([1, 1])  # sequence 1: inserted first, used last and most often
    cache.match([1, 1])
    cache.evict(2)
    remaining = [c.key for c in cache.root.children.values()]
    assert remaining == [expect_left]


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), list(range(999)) + [5]) == 999
