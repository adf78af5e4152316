"""RadixCache against a brute-force reference, driven by random operation sequences."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix import common_prefix_len
from radixserve.cache.radix_cache import RadixCache

TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=14)


# What each policy evicts first, from the reference's own bookkeeping of every cached page:
# [created tick, last access tick, hits]. Ties go to the older node (lower node id).
REFERENCE_KEYS = {
    "lru": lambda created, last, hits: (last,),
    "lfu": lambda created, last, hits: (hits, last),
    "fifo": lambda created, last, hits: (created,),
}


class RadixCacheMachine(RuleBasedStateMachine):
    """The reference is a dict from every cached page-aligned prefix to the slots of its tokens,
    plus, per prefix, when its last page was created, last accessed and how often it was matched:
    enough to predict which nodes each eviction policy removes."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def setup(self, page_size: int, policy: str) -> None:
        self.page = page_size
        self.policy = policy
        self.alloc = PageAllocator(num_pages=64 // page_size, page_size=page_size)
        self.cache = RadixCache(self.alloc, page_size=page_size, eviction_policy=policy)
        self.ref: dict[tuple, list[int]] = {}
        self.usage: dict[tuple, list[int]] = {}  # prefix -> [created, last access, hits]
        self.tick = 0  # the cache's clock: one tick per match and per insert
        self.locked: list = []

    def _aligned(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.page]

    def _ref_match(self, tokens: list[int]) -> tuple[int, list[int]]:
        tokens = self._aligned(tokens)
        for n in range(len(tokens), 0, -self.page):
            if tuple(tokens[:n]) in self.ref:
                return n, self.ref[tuple(tokens[:n])]
        return 0, []

    def _pages(self, tokens: list[int]) -> list[tuple]:
        return [tuple(tokens[:i]) for i in range(self.page, len(tokens) + 1, self.page)]

    def _nodes(self) -> dict:
        """Every node of the tree -> (the tokens from the root to its end, its parent)."""
        out = {}
        stack = [((), self.cache.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                out[child] = (prefix + tuple(child.key), node)
                stack.append((prefix + tuple(child.key), child))
        return out

    def _expected_eviction(self, n: int) -> tuple[int, set]:
        """Replay evict(n) on the tree's current shape with the reference's usage counts: unlocked
        leaves go in policy order until n tokens are freed. Returns (freed, the evicted pages)."""
        nodes = self._nodes()
        children = {node: 0 for node in nodes}
        for node, (_, parent) in nodes.items():
            if parent in children:
                children[parent] += 1
        locked = [tuple(tokens) for tokens, _ in self.locked]
        key = REFERENCE_KEYS[self.policy]

        def evictable(node) -> bool:
            end = nodes[node][0]
            return children[node] == 0 and not any(t[:len(end)] == end for t in locked)

        freed, evicted = 0, set()
        candidates = {node for node in nodes if evictable(node)}
        while freed < n and candidates:
            victim = min(candidates, key=lambda v: (key(*self.usage[nodes[v][0]]), v.node_id))
            candidates.remove(victim)
            end, parent = nodes[victim]
            freed += len(victim.key)
            evicted.update(self._pages(list(end))[-(len(victim.key) // self.page):])
            if parent in children:
                children[parent] -= 1
                if evictable(parent):
                    candidates.add(parent)
        return freed, evicted

    def _evict(self, n: int) -> int:
        expect_freed, expect_evicted = self._expected_eviction(n)
        freed = self.cache.evict(n)
        assert freed == expect_freed
        self._sync_after_eviction(expect_evicted)
        return freed

    def _sync_after_eviction(self, evicted: set) -> None:
        """Evictions drop whole leaves: the tree must hold the reference minus exactly the pages of
        the nodes the policy picks."""
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
        gone = set(self.ref) - set(present)
        assert gone == evicted, f"{self.policy} evicted {sorted(gone)}, the reference expects {sorted(evicted)}"
        self.ref = present
        self.usage = {key: self.usage[key] for key in present}

    inserted = Bundle("inserted")

    @rule(target=inserted, tokens=TOKENS)
    def insert(self, tokens: list[int]) -> list[int]:
        tokens = self._aligned(tokens)
        pages = len(tokens) // self.page
        if pages > len(self.alloc._free_pages):
            self._evict(pages * self.page)
            if pages > len(self.alloc._free_pages):
                return tokens
        slots = self.alloc.pages_to_slots(self.alloc.alloc_pages(pages)) if pages else torch.empty(0, dtype=torch.int64)
        expect_cached, _ = self._ref_match(tokens)
        already = self.cache.insert(tokens, slots)
        self.tick += 1
        assert already == expect_cached
        self.alloc.free_slots(slots[:already])  # the caller's duplicates
        prev: list[int] = []
        for i in range(self.page, len(tokens) + 1, self.page):
            prev = self.ref.setdefault(tuple(tokens[:i]), prev + slots[i - self.page:i].tolist())
        for key in self._pages(tokens):  # the cached part is touched, the rest is new
            usage = self.usage.setdefault(key, [self.tick, self.tick, 0])
            usage[1] = self.tick
        return tokens

    @rule(tokens=TOKENS, lock=st.booleans())
    def match(self, tokens: list[int], lock: bool) -> None:
        peek_len, _ = self.cache.peek(tokens)
        result = self.cache.match(tokens)
        self.tick += 1
        n, slots = self._ref_match(tokens)
        for key in self._pages(tokens[:n]):
            self.usage[key][1] = self.tick
            self.usage[key][2] += 1
        assert peek_len == result.length == n
        assert result.slots.tolist() == slots
        if lock and n:
            self.cache.lock(result.last_node)
            self.locked.append((tokens[:n], result.last_node))

    # Looking up what was inserted: hits on whole leaves, so LRU, LFU and FIFO orders diverge.
    @rule(tokens=inserted, lock=st.booleans())
    def match_inserted(self, tokens: list[int], lock: bool) -> None:
        self.match(tokens, lock)

    @precondition(lambda self: self.locked)
    @rule(index=st.integers(0, 100))
    def unlock(self, index: int) -> None:
        _, node = self.locked.pop(index % len(self.locked))
        self.cache.unlock(node)

    # Small evictions most often: they show which leaf the policy picks first.
    @rule(n=st.one_of(st.integers(1, 4), st.integers(1, 40)))
    def evict(self, n: int) -> None:
        before = self.cache.memory.evictable
        freed = self._evict(n)
        assert freed >= min(n, before) or self.cache.memory.evictable == 0
        for tokens, _ in self.locked:  # locked prefixes survive any eviction
            assert self.cache.peek(tokens)[0] == len(tokens)

    @precondition(lambda self: not self.locked)
    @rule()
    def flush(self) -> None:
        assert self.cache.flush()
        self.ref, self.usage = {}, {}
        assert self.alloc.free_tokens == self.alloc.total_tokens

    @invariant()
    def sizes_add_up(self) -> None:
        if hasattr(self, "cache"):
            self.cache.memory.check()


RadixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_radix_cache_against_reference = RadixCacheMachine.TestCase


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_evictions_follow_the_reference_policy_on_random_workloads(policy: str) -> None:
    """The reference machine driven by seeded random operations that reuse inserted sequences
    (hits on whole leaves), with small evictions: every eviction must remove exactly the nodes
    the policy's reference order picks. Deterministic, and far more evictions that tell the
    policies apart than the generic state machine reaches."""
    for seed in range(60):
        rng = random.Random(seed)
        machine = RadixCacheMachine()
        machine.setup(page_size=rng.choice([1, 2, 4]), policy=policy)
        inserted: list[list[int]] = []
        for _ in range(40):
            op = rng.randrange(4)
            if op == 0:
                inserted.append(machine.insert([rng.randrange(4) for _ in range(rng.randrange(15))]))
            elif op == 1 and inserted:
                machine.match(rng.choice(inserted), rng.random() < 0.3)
            elif op == 2:
                machine.evict(rng.randrange(1, 5))
            elif machine.locked:
                machine.unlock(rng.randrange(100))
            machine.sizes_add_up()


def test_flush_is_refused_while_locked() -> None:
    alloc = PageAllocator(16, 1)
    cache = RadixCache(alloc)
    slots = alloc.pages_to_slots(alloc.alloc_pages(4))
    cache.insert([1, 2, 3, 4], slots)
    m = cache.match([1, 2, 3, 4])
    cache.lock(m.last_node)
    assert not cache.flush()
    cache.unlock(m.last_node)
    assert cache.flush()
    cache.memory.check()


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


@pytest.mark.parametrize("policy,expect_left", [("lru", [[2, 2], [3, 3]]), ("fifo", [[2, 2], [3, 3]]),
                                                ("lfu", [[1, 1], [3, 3]])])
def test_eviction_order_follows_policy(policy: str, expect_left: list[list[int]]) -> None:
    """Sequence 1: inserted first, matched most often. Sequence 2: inserted later, matched once.
    Sequence 3: matched last, most often. Each policy evicts a different one of 1 and 2 first."""
    alloc = PageAllocator(16, 1)
    cache = RadixCache(alloc, eviction_policy=policy)
    for seq in (1, 2, 3):
        slots = alloc.pages_to_slots(alloc.alloc_pages(2))
        cache.insert([seq, seq], slots)
    for seq in (1, 1, 1, 2, 3, 3, 3, 3):
        cache.match([seq, seq])
    cache.evict(2)
    remaining = sorted(c.key for c in cache.root.children.values())
    assert remaining == expect_left


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), list(range(999)) + [5]) == 999
