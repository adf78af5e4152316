"""The radix cache with a host tier against a brute-force reference, driven by random operation
sequences: inserts, lookups that lock (running requests), unlocks (finishes and retractions),
device evictions (write-backs), loads and the copy engine reporting them done.

Every token's KV is a number derived from its whole prefix, written when the prefix is inserted,
so each lookup also checks that write-backs and loads moved the right bytes to the right slots.
With a host tier as large as everything inserted, nothing may ever be lost: the reference is then
the exact set of inserted prefixes. With a small one, the tree may forget prefixes (host eviction)
but never invents one and never hands out wrong KV.
"""

from __future__ import annotations

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.page_events import page_events
from radixserve.cache.block_hash import page_hashes
from radixserve.cache.host_pool import copy_runs
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.factory import host_tier, tree_cache

TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=14)
LAYERS = 2
DEVICE_TOKENS = 32


def kv_of(prefix: tuple, layer: int) -> float:
    """The KV the reference expects for the last token of prefix, in layer."""
    return float(hash(prefix) % 100003 + layer * 0.5)


class TieredCacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), host_tokens=st.sampled_from([16, 1024]),
                write_through=st.booleans())
    def setup(self, page_size: int, host_tokens: int, write_through: bool) -> None:
        self.page = page_size
        self.pool = KVPool(DEVICE_TOKENS, page_size, LAYERS, 1, 2, torch.float32, "cpu")
        self.alloc = self.pool.allocator
        self.cache = tree_cache(self.pool, host_tier(self.pool, host_tokens), write_through=write_through)
        self.exact = host_tokens >= 1024  # room for everything: nothing may be lost
        self.ref: set[tuple] = set()  # every cached page-aligned prefix
        self.locked: list = []
        self.waiting: list = []  # nodes waiting requests are parked on (queue-aware eviction)
        # The KV events a cluster's router follows: per tier, the pages they say are there.
        self.events = page_events(self.cache)
        self.events.follow_blocks()
        self.published: dict[str, set[int]] = {"GPU": set(), "CPU": set()}

    def _aligned(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.page]

    def _ref_len(self, tokens: list[int]) -> int:
        tokens = self._aligned(tokens)
        for n in range(len(tokens), 0, -self.page):
            if tuple(tokens[:n]) in self.ref:
                return n
        return 0

    def _present(self) -> set[tuple]:
        out, stack = set(), [((), self.cache.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                for i in range(self.page, len(child.key) + 1, self.page):
                    out.add(prefix + tuple(child.key[:i]))
                stack.append((prefix + tuple(child.key), child))
        return out

    def _sync(self) -> None:
        present = self._present()
        assert present <= self.ref, "the tree holds a prefix never inserted"
        if self.exact:
            assert present == self.ref, f"lost {sorted(self.ref - present)} with room on the host"
        self.ref = present

    def _check_kv(self, tokens: list[int], slots: torch.Tensor) -> None:
        for i, slot in enumerate(slots.tolist()):
            for layer in range(LAYERS):
                got = self.pool.k_buffers[layer][slot, 0, 0].item()
                assert got == kv_of(tuple(tokens[:i + 1]), layer), f"wrong K at position {i}, layer {layer}"
                assert self.pool.v_buffers[layer][slot, 0, 1].item() == -got

    inserted = Bundle("inserted")

    @rule(target=inserted, tokens=TOKENS)
    def insert(self, tokens: list[int]) -> list[int]:
        tokens = self._aligned(tokens)
        pages = len(tokens) // self.page
        if pages > len(self.alloc._free_pages):
            self.cache.evict(pages * self.page - self.alloc.free_tokens)
            if pages > len(self.alloc._free_pages):
                return tokens
        slots = self.alloc.pages_to_slots(self.alloc.alloc_pages(pages)) if pages else torch.empty(0, dtype=torch.int64)
        for i, slot in enumerate(slots.tolist()):  # "compute" the KV of every position
            for layer in range(LAYERS):
                self.pool.k_buffers[layer][slot] = kv_of(tuple(tokens[:i + 1]), layer)
                self.pool.v_buffers[layer][slot, 0, 1] = -kv_of(tuple(tokens[:i + 1]), layer)
        already = self.cache.insert(tokens, slots)
        self.alloc.free_slots(slots[:already])  # the caller's duplicates
        self.ref.update(tuple(tokens[:i]) for i in range(self.page, len(tokens) + 1, self.page))
        assert self.cache.match(tokens).length == len(tokens), "an inserted prefix is not on the device"
        self._sync()
        return tokens

    @rule(tokens=TOKENS, lock=st.booleans())
    def match(self, tokens: list[int], lock: bool) -> None:
        peek_len, node = self.cache.peek(tokens)
        assert peek_len == self._ref_len(tokens), "peek disagrees with the cached prefixes (both tiers)"
        host, loading = self.cache.host_part(peek_len, node)
        result = self.cache.match(tokens)
        assert result.length == peek_len - host, "the device part of a match"
        self._check_kv(tokens, result.slots)
        if lock and result.length:
            self.cache.lock(result.last_node)
            self.locked.append((tokens[:result.length], result.last_node))

    @rule(tokens=inserted, lock=st.booleans())
    def match_inserted(self, tokens: list[int], lock: bool) -> None:
        self.match(tokens, lock)

    @rule(tokens=st.one_of(inserted, TOKENS), spare_only=st.booleans())
    def load(self, tokens: list[int], spare_only: bool) -> None:
        before = self.cache.match(tokens).length
        loading = self.cache.load(tokens, spare_only=spare_only)
        peek_len, node = self.cache.peek(tokens)
        if loading:
            host, in_flight = self.cache.host_part(peek_len, node)
            assert in_flight and host >= loading
            assert self.cache.match(tokens).length == before, "a loading node is matched before its copy is done"
        self._sync()

    @rule()
    def poll(self) -> None:
        self.cache.waiting.poll()
        assert self.cache.loading_tokens == 0  # CPU copies finish at once; poll reports them all

    @rule(tokens=st.one_of(inserted, TOKENS))
    def wait(self, tokens: list[int]) -> None:
        _, node = self.cache.peek(tokens)
        self.cache.waiting.add_waiter(node)
        self.waiting.append(node)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100))
    def stop_waiting(self, index: int) -> None:
        self.cache.waiting.remove_waiter(self.waiting.pop(index % len(self.waiting)))

    @precondition(lambda self: self.locked)
    @rule(index=st.integers(0, 100))
    def unlock(self, index: int) -> None:
        _, node = self.locked.pop(index % len(self.locked))
        self.cache.unlock(node)

    @precondition(lambda self: self.locked)
    @rule(index=st.integers(0, 100), extra=TOKENS)
    def leave(self, index: int, extra: list[int]) -> None:
        """A running request leaves (finished or retracted): the pages it computed after its locked
        prefix go into the tree, then its lock goes (KVManager.cache_req)."""
        prefix, node = self.locked.pop(index % len(self.locked))
        extra = self._aligned(extra)
        own = self.alloc.alloc_pages(len(extra) // self.page)
        if own is None:
            self.cache.unlock(node)
            return
        tokens = prefix + extra
        own_slots = self.alloc.pages_to_slots(own) if own else torch.empty(0, dtype=torch.int64)
        for i, slot in enumerate(own_slots.tolist(), start=len(prefix)):
            for layer in range(LAYERS):
                self.pool.k_buffers[layer][slot] = kv_of(tuple(tokens[:i + 1]), layer)
                self.pool.v_buffers[layer][slot, 0, 1] = -kv_of(tuple(tokens[:i + 1]), layer)
        slots = torch.cat([self.cache.match(prefix).slots, own_slots])
        already = self.cache.insert(tokens, slots)
        assert already >= len(prefix), "the locked prefix stayed on the device"
        self.alloc.free_slots(slots[len(prefix):already])
        self.cache.unlock(node)
        self.ref.update(tuple(tokens[:i]) for i in range(self.page, len(tokens) + 1, self.page))
        self._check_kv(tokens, self.cache.match(tokens).slots)
        self._sync()

    @rule(n=st.integers(1, 40))
    def evict(self, n: int) -> None:
        self.cache.evict(n)
        for tokens, _ in self.locked:  # locked prefixes stay on the device
            assert self.cache.match(tokens).length == len(tokens)
        self._sync()

    @precondition(lambda self: not self.locked and not self.cache.loading_tokens)
    @rule()
    def flush(self) -> None:
        assert self.cache.flush()
        for node in self.waiting:
            self.cache.waiting.remove_waiter(node)
        self.ref, self.waiting = set(), []
        assert self.alloc.free_tokens == self.alloc.total_tokens
        assert self.cache.host.host_allocator.free_tokens == self.cache.host.host_allocator.total_tokens

    @invariant()
    def sizes_add_up(self) -> None:
        if hasattr(self, "cache"):
            self.cache.memory.check()

    @invariant()
    def kv_events_say_what_each_tier_holds(self) -> None:
        """Replaying the block events gives exactly the pages on each tier: nothing stored twice,
        nothing removed that was not stored, every page's hash chained from its path."""
        if not hasattr(self, "cache"):
            return
        for event in self.events.take_blocks():
            if event[0] == "AllBlocksCleared":
                self.published = {"GPU": set(), "CPU": set()}
            elif event[0] == "BlockStored":
                _, hashes, _, tokens, medium = event
                assert len(tokens) == len(hashes) * self.page
                assert not self.published[medium] & set(hashes), "a block stored twice"
                self.published[medium] |= set(hashes)
            else:
                _, hashes, medium = event
                assert set(hashes) <= self.published[medium], "a block removed that was never stored"
                self.published[medium] -= set(hashes)
        held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        stack = [(self.cache.root, None)]
        while stack:
            node, parent_hash = stack.pop()
            for child in node.children.values():
                hashes = page_hashes(child.key, self.page, parent_hash)
                if child.value is not None:
                    held["GPU"] |= set(hashes)
                if child.host is not None:
                    held["CPU"] |= set(hashes)
                stack.append((child, hashes[-1]))
        assert self.published == held


TieredCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tiered_cache_against_reference = TieredCacheMachine.TestCase


def test_copy_runs_group_consecutive_host_slots() -> None:
    assert copy_runs(torch.tensor([4, 5, 6, 9, 10, 2], dtype=torch.int64)) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert copy_runs(torch.empty(0, dtype=torch.int64)) == []


def test_a_loading_prefix_is_locked_until_poll_reports_its_copy() -> None:
    pool = KVPool(16, 1, 1, 1, 2, torch.float32, "cpu")
    cache = tree_cache(pool, host_tier(pool, 64))
    slots = pool.allocator.pages_to_slots(pool.allocator.alloc_pages(8))
    cache.insert(list(range(8)), slots)
    assert cache.evict(8) == 8 and pool.allocator.free_tokens == 16
    assert cache.peek(list(range(8)))[0] == 8 and cache.match(list(range(8))).length == 0
    assert cache.load(list(range(8)), spare_only=True) == 8
    assert cache.memory.protected == 8 and cache.evict(16) == 0  # locked while loading
    assert cache.host_part(*cache.peek(list(range(8)))) == (8, True)
    cache.waiting.poll()
    assert cache.memory.protected == 0 and cache.match(list(range(8))).length == 8
    assert cache.host_part(*cache.peek(list(range(8)))) == (0, False)
    cache.memory.check()
    assert cache.flush()
