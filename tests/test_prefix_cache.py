"""Each prefix cache (the device tree, the tree with a host tier, a hybrid model's tree with
recurrent-state snapshots, that tree over a host tier which keeps snapshots too, the cache that
keeps nothing) driven through the `PrefixCache` protocol and its parts
exactly as the scheduler drives it: the real
`WaitingQueue` parks requests on their peeked matches, host parts are loaded back through
`PrefixCache.admit` as the scheduler asks for them, and the real `KVManager` locks a match, grows a request, caches its
finished chunks and gives everything back when it leaves, with evictions, polls and flushes in
between.

Every position's KV is a number derived from its whole prefix, written when a request "computes"
it, so whatever a match hands out is checked to be the KV of exactly those tokens. After every
operation: the pool's slots are each owned once (free, cached or a running request's), the sizes
add up, each node's waiter count is the requests parked at or below it, nothing is reported
cached that no request of the same cache namespace (its cache_salt) computed, and a cache that
keeps nothing holds nothing and finds nothing. Both event streams follow the cache: the vLLM-format
block events replay to exactly the pages on each tier, and the `/kv_events` block hashes to
exactly the tree's blocks, which a router's mirror then matches each waiting request against,
hashed from the request's salt as the router hashes it, finding what the cache finds (with
snapshots: what lies on paths to them, `reusable_len`).

The snapshot cache's request rows hold a simulated recurrent state: a number derived from the
prefix a row has computed, written when a request "computes", read back when a piece continues it
(so a restored snapshot must be the state of exactly the matched prefix), and a step that fails
part-way leaves garbage in its rows (`fail_step`). Invariants: every snapshot slot is owned once
(a node, a running request's row, the free list), a node's snapshot holds the state of its path,
the usable match never runs past the KV match, and nothing is held by rows when none runs. Over
a host tier the same holds of the host snapshot slots (a host-only node or the free list), a host
snapshot holds its path's state too, and a request admitted after its load resumes from the state
that came back.
The implementation-specific machines (test_radix_cache.py: exact eviction order; test_tiered_cache.py:
what each tier holds) go deeper into each one.
"""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.page_events import page_events
from radixserve.cache.block_hash import page_hashes
from radixserve.cache.factory import host_tier, tree_cache
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.cache.namespace import cache_namespace, namespace_page_parent
from radixserve.cache.no_cache import NoPrefixCache
from radixserve.cache.conversations import Conversations
from radixserve.cache.prefix_cache import CacheMemory, OwnedPrefixCache, PrefixCache
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.cache.state_snapshots import StateSnapshots
from radixserve.cache.waiting_view import WaitingView
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.request import Req, ReqState
from radixserve.scheduler.waiting_queue import WaitingQueue
from radixserve.router.keys import routing_keys
from radixserve.router.prefix_tree import BlockHashMirror

KINDS = ("device", "tiered", "snapshot", "tiered-snapshot", "none")
TIERED = ("tiered", "tiered-snapshot")
SNAPSHOTS = ("snapshot", "tiered-snapshot")
LAYERS = 2
DEVICE_TOKENS = 48
ROWS = 4
PROMPTS = st.lists(st.integers(0, 2), min_size=2, max_size=20)
SALTS = (None, "tenant-a", "tenant-b")  # requests' cache_salt: None is the shared namespace
HASH_BLOCK = 4  # tokens per /kv_events block here: a whole number of pages
# One float64 per row and snapshot: the simulated recurrent state.
STATE_SPEC = RecurrentStateSpec(num_layers=1, conv_shape=(1, 1), ssm_shape=(1, 1, 1), conv_dtype=torch.float64,
                                ssm_dtype=torch.float64)
GARBAGE = -1.0  # what a step that failed part-way leaves in its rows


def make_cache(kind: str, pool: KVPool, *, host_tokens: int = 1024, write_through: bool = False,
               snapshot_slots: int = 6, host_snapshot_slots: int = 4) -> PrefixCache:
    if kind == "none":
        return NoPrefixCache(pool.allocator, page_size=pool.page_size)
    if "snapshot" in kind:
        pool.state = RecurrentStatePool(ROWS, STATE_SPEC, "cpu")
        pool.snapshots = StateSnapshots(snapshot_slots, pool.state)
    host = host_tier(pool, host_tokens, host_snapshot_slots) if kind.startswith("tiered") else None
    # Branch points of a single page are taken too: the prompts here are short.
    return tree_cache(pool, host, write_through=write_through, branch_min_tokens=1)


def state_of(prefix: tuple) -> float:
    """The simulated recurrent state after computing prefix."""
    return float(hash(("state",) + prefix) % 100003) + 0.25


def kv_of(prefix: tuple, layer: int) -> float:
    """The KV expected for the last token of prefix, in layer."""
    return float(hash(prefix) % 100003 + layer * 0.5)


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(KINDS), page_size=st.sampled_from([1, 2, 4]),
                host_tokens=st.sampled_from([16, 1024]), write_through=st.booleans(),
                snapshot_slots=st.sampled_from([2, 6]), host_snapshot_slots=st.sampled_from([0, 1, 4]))
    def setup(self, kind: str, page_size: int, host_tokens: int, write_through: bool, snapshot_slots: int,
              host_snapshot_slots: int) -> None:
        self.kind = kind
        self.page = page_size
        self.pool = KVPool(DEVICE_TOKENS, page_size, LAYERS, 1, 2, torch.float32, "cpu")
        self.alloc = self.pool.allocator
        self.cache = make_cache(kind, self.pool, host_tokens=host_tokens, write_through=write_through,
                                snapshot_slots=snapshot_slots, host_snapshot_slots=host_snapshot_slots)
        assert isinstance(self.cache, PrefixCache)
        self.kv = KVManager(self.cache, ReqToTokenPool(ROWS, 64, "cpu"))
        self.waiting = WaitingQueue(self.cache, "fcfs", max_wait_s=1e9)
        self.running: list[Req] = []
        # (namespace, prefix) of every prefix whose KV some request computed and gave the cache
        self.computed: set[tuple] = set()
        self.arrivals = 0
        self.salts = {cache_namespace(salt): salt for salt in SALTS}
        # One recorder feeds both: per-tier blocks (the vLLM-format publisher) and /kv_events.
        self.block_events = page_events(self.cache, block_tokens=HASH_BLOCK)
        self.block_events.follow_blocks()
        self.published: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.token_less: dict[int, bool] = {}  # block hash -> whether it was stored without its token ids
        self.hash_events = self.block_events
        self.mirror = set(self.hash_events.snapshot()["blocks"])  # recording starts with a snapshot

    # ------------------------------------------------------------------ helpers
    def _write_kv(self, req: Req, start: int, end: int, captures: list[tuple[int, int]] = ()) -> None:
        """"Compute" positions [start, end) of req into its own slots (and its row's state, which a
        piece after the first continues: it must hold the state of exactly what came before; and
        the states the cache captures on the way, into their snapshot slots)."""
        tokens = req.fill_ids
        if self.pool.state is not None:
            ssm = self.pool.state.ssm[0]
            if start > 0:
                assert ssm[req.req_pool_idx].item() == state_of(tuple(tokens[:start])), \
                    f"row {req.req_pool_idx} does not hold the state of its first {start} positions"
            for position, slot in captures:
                assert start < position < end, f"a capture at {position} outside the piece [{start}, {end})"
                self.pool.snapshots.ssm[0][slot] = state_of(tuple(tokens[:position]))
            ssm[req.req_pool_idx] = state_of(tuple(tokens[:end]))
        for pos in range(start, end):
            slot = req.slots[pos]
            for layer in range(LAYERS):
                value = kv_of(tuple(tokens[:pos + 1]), layer)
                self.pool.k_buffers[layer][slot] = value
                self.pool.v_buffers[layer][slot, 0, 1] = -value

    def _check_kv(self, tokens: list[int], slots: list[int]) -> None:
        for pos, slot in enumerate(slots):
            for layer in range(LAYERS):
                got = self.pool.k_buffers[layer][slot, 0, 0].item()
                assert got == kv_of(tuple(tokens[:pos + 1]), layer), f"wrong K at position {pos}, layer {layer}"
                assert self.pool.v_buffers[layer][slot, 0, 1].item() == -got

    def _keeps(self) -> bool:
        return self.kind != "none"

    def _schedule(self) -> None:
        """The start of a step's scheduling: the cache takes in what the steps before did."""
        self.cache.waiting.poll()
        self.waiting.refresh()

    def _gave(self, req: Req, n: int) -> None:
        tokens = req.fill_ids
        self.computed.update((req.cache_namespace, tuple(tokens[:i])) for i in range(self.page, n + 1, self.page))

    # ------------------------------------------------------------------ waiting
    prompts = Bundle("prompts")

    # A prompt sent before comes back (a retry, another user's shared prefix), or a later turn
    # extends it: hits, shared prefixes computed twice at once, and splits.
    # Several copies at once, admitted at once or not: a prefix computed by two requests at once.
    # The same prompts come with different salts too: they must never find each other's prefixes.
    @rule(target=prompts, prompt=st.one_of(PROMPTS, prompts, st.tuples(prompts, PROMPTS).map(lambda t: t[0] + t[1])),
          copies=st.integers(1, 3), admit_now=st.booleans(), salt=st.sampled_from(SALTS))
    def arrive(self, prompt: list[int], copies: int, admit_now: bool, salt) -> list[int]:
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        for _ in range(copies):
            req = Req(rid=f"r{self.arrivals}", origin_input_ids=list(prompt[:40]), sampling_params=params,
                      arrival_time=0.0, arrival_seq=self.arrivals, cache_namespace=cache_namespace(salt))
            self.arrivals += 1
            self.waiting.add(req)
            if admit_now and self.kv.req_to_token.free_rows:
                self._admit(req)
        return list(prompt[:40])

    @precondition(lambda self: self.kind == "tiered-snapshot" and self.kv.req_to_token.free_rows)
    @rule(target=prompts, prompt=prompts, more=PROMPTS, salt=st.sampled_from(SALTS))
    def next_turn_from_the_host(self, prompt: list[int], more: list[int], salt) -> list[int]:
        """A conversation's turn runs to its end and leaves, everything nobody holds goes to the host,
        and the next turn arrives: admitted (after its load) on the state that came back, if the
        host kept it."""
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        turns = [list(prompt[:40]), list((prompt + more)[:40])]
        reqs = [Req(rid=f"r{self.arrivals + i}", origin_input_ids=turn, sampling_params=params, arrival_time=0.0,
                    arrival_seq=self.arrivals + i, cache_namespace=cache_namespace(salt)) for i, turn in enumerate(turns)]
        self.arrivals += 2
        first, second = reqs
        self.waiting.add(first)
        self._admit(first)
        while first.kv_len < len(first.origin_input_ids) and self._compute_whole(first):
            pass
        self.running.remove(first)
        computed = first.kv_len
        self.kv.cache_req(first, finished=True)
        self._gave(first, self.cache.insertable_len(computed))
        self.cache.evict(self.cache.memory.evictable)
        hits = self.cache.snapshot_stats()["host_snapshot_hits"]
        self.waiting.add(second)
        self._admit(second)  # checks that a resumed row holds the state of exactly its prefix
        if self.cache.snapshot_stats()["host_snapshot_hits"] > hits:
            assert second.locked_len > 0
        return turns[1]

    # Rules that are always possible are offered only where they can do something: hypothesis picks
    # among the possible rules evenly, and the runs should mostly serve requests.
    @precondition(lambda self: self.kind in TIERED and len(self.waiting))
    @rule(index=st.integers(0, 100), spare_only=st.booleans())
    def load(self, index: int, spare_only: bool) -> None:
        """As when admission reaches a waiting request: its host part is copied back (PrefixCache.admit)."""
        req = list(self.waiting)[index % len(self.waiting)]
        admission = self.cache.admit(req, room=DEVICE_TOKENS, spare_only=spare_only)
        if admission.loading:
            assert admission.waits, "a load started for a request admission does not wait for"
            peeked = self.cache.peek(req.match_target(), namespace=req.cache_namespace)
            assert self.cache.host_part(*peeked)[1], "a load started but is not in flight"
            peeked = self.cache.peek(req.match_target(), namespace=req.cache_namespace)
            assert self.cache.host_part(*peeked)[1], "a load started but is not in flight"

    @precondition(lambda self: self.kind in TIERED and self.cache.loading_tokens)
    @rule()
    def poll(self) -> None:
        self.cache.waiting.poll()
        self.waiting.refresh()
        assert self.cache.loading_tokens == 0  # CPU copies are done as they are issued

    # ------------------------------------------------------------------ running
    @precondition(lambda self: len(self.waiting) and self.kv.req_to_token.free_rows)
    @rule(index=st.integers(0, 100))
    def admit(self, index: int) -> None:
        self.waiting.refresh()
        self._admit(list(self.waiting)[index % len(self.waiting)])

    @precondition(lambda self: len(self.waiting) and self.kv.req_to_token.free_rows)
    @rule(index=st.integers(0, 100))
    def admit_and_undo(self, index: int) -> None:
        """As PrefillAdder.try_add_one when the request's memory does not fit: admitted on its
        match, then given back (KVManager.unlock_prefix); no snapshot hit is counted."""
        self.waiting.refresh()
        req = list(self.waiting)[index % len(self.waiting)]
        hits = self.cache.snapshot_stats()
        self._admit(req)
        self.running.remove(req)
        self.kv.unlock_prefix(req)
        req.state = ReqState.WAITING
        self.waiting.add(req)
        after = self.cache.snapshot_stats()
        for counter in ("snapshot_hits", "host_snapshot_hits"):
            assert after[counter] == hits[counter], f"an undone admission counted in {counter}"

    def _admit(self, req: Req) -> None:
        """As PrefillAdder.try_add_one: a row, the cached prefix locked and pointed at; a host part
        is loaded back first, as the scheduler does when admission reaches a request (it admits
        the request once the copy is done), and so is a host snapshot it would resume from."""
        self._schedule()
        admission = self.cache.admit(req, room=DEVICE_TOKENS, spare_only=False)
        if admission.waits:
            self.cache.waiting.poll()
            self.waiting.refresh()
            if admission.loading:
                assert self.cache.host_part(req.peek_len, req.peek_node) == (0, False), "a finished load left a host part"
            admission = self.cache.admit(req, room=DEVICE_TOKENS, spare_only=False)
        peeked = req.peek_len
        if self.kind not in TIERED:
            assert admission.ready and not admission.loading, "a wait without a host tier"
        self.waiting.remove(req)
        req.req_pool_idx = self.kv.req_to_token.alloc()
        self.kv.lock_prefix(req, admission)
        assert req.locked_len <= peeked and req.locked_len % self.page == 0
        if not self._keeps():
            assert req.locked_len == 0 and req.last_node is self.cache.root
        elif self.kind in ("device", "snapshot"):
            assert req.locked_len == peeked, "the device tree's match is its peek"
        if self.kind in SNAPSHOTS:
            kv_len, _ = RadixCache.peek(self.cache, req.match_target(), namespace=req.cache_namespace)
            assert req.locked_len <= kv_len, "a usable match runs past the KV"
            if req.locked_len:  # resumed: the snapshot was copied into the row
                got = self.pool.state.ssm[0][req.req_pool_idx].item()
                assert got == state_of(tuple(req.fill_ids[:req.locked_len])), "a restored state is not its prefix's"
            assert all(req.locked_len < end < len(req.fill_ids) for end in req.chunk_ends)
        else:
            assert req.chunk_ends == ()
        self._check_kv(req.fill_ids, req.slots[:req.locked_len])
        req.state = ReqState.RUNNING
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), n=st.one_of(st.integers(1, 6), st.just(40)))
    def compute(self, index: int, n: int) -> None:
        """A prompt chunk: slots for n more positions (evicting if short), their KV written, and
        the chunk given to the cache while the request goes on (KVManager.cache_req)."""
        self._compute(self.running[index % len(self.running)], n)

    @precondition(lambda self: self.running)
    @rule(n=st.one_of(st.integers(1, 6), st.just(40)))
    def step(self, n: int) -> None:
        """A step: a chunk of every running request, in order."""
        for req in list(self.running):
            self._compute(req, n)

    def _compute(self, req: Req, n: int) -> None:
        self._schedule()
        before = req.kv_len
        upto = min(before + n, len(req.origin_input_ids))
        upto = min([upto] + [end for end in req.chunk_ends if end > before])  # as PrefillAdder._add_piece
        if upto == before or not self.kv.grow(req, upto):
            return
        self._write_kv(req, before, upto, self.kv.capture_states(req, before, upto))
        locked_before = req.locked_len
        self.kv.cache_req(req, finished=False)
        taken = self.cache.insertable_len(upto)
        if not self._keeps():
            assert taken == 0 and req.locked_len == 0
        else:
            assert req.locked_len == max(locked_before, taken), "the chunk is held on the cache's copy"
            self._gave(req, taken)
        self._check_kv(req.fill_ids, req.slots[:req.kv_len])

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), finish=st.booleans())
    def leave(self, index: int, finish: bool) -> None:
        """The request finishes (its whole prompt computed first), is aborted or retracted:
        everything it holds goes back."""
        req = self.running.pop(index % len(self.running))
        if finish:
            while req.kv_len < len(req.origin_input_ids) and self._compute_whole(req):
                pass
        tokens, computed = req.fill_ids, req.kv_len
        self.kv.cache_req(req, finished=True)
        assert req.req_pool_idx is None and not req.slots and req.last_node is None
        taken = self.cache.insertable_len(computed)
        found, _ = self.cache.peek(tokens[:taken], namespace=req.cache_namespace)
        if self.kind in SNAPSHOTS:  # found where a snapshot was kept
            self._gave(req, taken)
            assert found <= taken
        elif self._keeps():
            self._gave(req, taken)
            assert found == taken, "what a leaving request gave the cache is found at once"
        else:
            assert taken == 0 and found == 0

    def _compute_whole(self, req: Req) -> bool:
        """The rest of req's prompt, piece by piece as its chunk ends cut it; False when it did not fit."""
        before = req.kv_len
        self._compute(req, len(req.origin_input_ids))
        return req.kv_len > before

    @precondition(lambda self: self.kind in SNAPSHOTS and self.running)
    @rule(index=st.integers(0, 100), n=st.integers(1, 8))
    def fail_step(self, index: int, n: int) -> None:
        """A step that failed part-way (the engine's allocation-failure path): its piece is taken back,
        its row holds garbage, and the request starts over (retracted), keeping nothing of the row."""
        req = self.running.pop(index % len(self.running))
        self._schedule()
        before = req.kv_len
        upto = min([before + n, len(req.origin_input_ids)] + [end for end in req.chunk_ends if end > before])
        if upto > before and self.kv.grow(req, upto):
            for _, slot in self.kv.capture_states(req, before, upto):  # half written too
                self.pool.snapshots.ssm[0][slot] = GARBAGE
            self.pool.state.ssm[0][req.req_pool_idx] = GARBAGE
            self.cache.states.discard_states([req.req_pool_idx])
            self.kv.shrink(req, before)
        else:
            self.cache.states.discard_states([req.req_pool_idx])
            self.pool.state.ssm[0][req.req_pool_idx] = GARBAGE
        self.kv.cache_req(req, finished=True)
        req.state = ReqState.WAITING
        self.waiting.add(req)

    # ------------------------------------------------------------------ memory
    @precondition(lambda self: self.cache.memory.evictable)
    @rule(n=st.integers(1, 40))
    def evict(self, n: int) -> None:
        self.cache.evict(n)
        for req in self.running:  # what running requests hold stays on the device
            held = self.cache.match(req.fill_ids[:req.locked_len], namespace=req.cache_namespace, kv_only=True)
            assert held.length == req.locked_len

    @precondition(lambda self: self.kind in TIERED and self.cache.memory.evictable)
    @rule()
    def evict_to_host(self) -> None:
        """Everything nobody holds leaves the device (to the host, where it has room), so that a
        later turn of a conversation finds its prefix, and its snapshot, only there."""
        self.cache.evict(self.cache.memory.evictable)  # (a node whose host copy a copy still uses stays)

    @precondition(lambda self: not self.running and self.cache.num_nodes > 1)
    @rule()
    def flush(self) -> None:
        assert self.cache.flush()
        self.waiting.refresh()
        assert self.alloc.free_tokens == self.alloc.total_tokens
        if self.pool.snapshots is not None:
            assert self.pool.snapshots.free_slots == self.pool.snapshots.num_slots
            host = self.pool.snapshots.host
            assert host is None or host.free_slots == host.num_slots

    # ------------------------------------------------------------------ invariants
    @invariant()
    def slots_are_owned_once_and_sizes_add_up(self) -> None:
        if hasattr(self, "cache"):
            self.kv.check_invariants(self.running)

    @invariant()
    def idle_rows_hold_no_snapshot(self) -> None:
        if not hasattr(self, "cache") or self.pool.snapshots is None or self.running:
            return
        stats = self.cache.snapshot_stats()
        assert self.pool.snapshots.free_slots + stats["snapshots_held"] == stats["snapshot_slots"], "a snapshot leaked"
        host = self.pool.snapshots.host
        if host is not None:
            assert host.free_slots + stats["host_snapshots_held"] == stats["host_snapshot_slots"], \
                "a host snapshot leaked"

    @invariant()
    def waiter_counts_are_the_parked_requests(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.waiting.refresh()
        expected: Counter = Counter()
        for req in self.waiting:
            node = req.peek_node
            while node is not None and node.parent is not None:
                expected[node] += 1
                node = node.parent
        for node in self.cache.waiting.iter_nodes():
            assert node.waiters == expected[node], f"{node}: {node.waiters} waiters, expected {expected[node]}"

    @invariant()
    def only_computed_prefixes_are_cached_with_their_kv(self) -> None:
        if not hasattr(self, "cache"):
            return
        for req in self.waiting:
            target = tuple(req.match_target()[:req.peek_len])
            assert req.peek_len == 0 or (req.cache_namespace, target) in self.computed, \
                "a prefix no request of its namespace computed"
            if not self._keeps():
                assert req.peek_len == 0
        stack = [((), self.cache.root, None)]
        while stack:
            prefix, node, namespace = stack.pop()
            for child in node.children.values():
                if child.namespace is not None:  # a namespace's own root
                    assert not child.key and node is self.cache.root and child.namespace in self.salts
                    stack.append(((), child, child.namespace))
                    continue
                path = prefix + tuple(child.key)
                assert (namespace, path[:self.page]) in self.computed and (namespace, path) in self.computed
                snapshot = child.state
                if snapshot is not None and snapshot.slot is not None \
                        and snapshot.slot not in getattr(self.cache, "queued_saves", ()):
                    got = self.pool.snapshots.ssm[0][snapshot.slot].item()
                    assert got == state_of(path), "a node's snapshot is not its path's state"
                if snapshot is not None and snapshot.host_slot is not None:
                    got = self.pool.snapshots.host.ssm[0][snapshot.host_slot].item()
                    assert got == state_of(path), "a node's host snapshot is not its path's state"
                if child.value is not None:  # on the device: its slots hold its tokens' KV
                    for i, slot in enumerate(child.value.tolist()):
                        for layer in range(LAYERS):
                            got = self.pool.k_buffers[layer][slot, 0, 0].item()
                            assert got == kv_of(path[:len(prefix) + i + 1], layer), "a node's KV is not its tokens'"
                stack.append((path, child, namespace))
        if not self._keeps():
            assert self.cache.num_nodes == 1 and not self.cache.root.children
            assert self.cache.memory.evictable == self.cache.memory.protected == 0


    @invariant()
    def kv_events_follow_the_cache(self) -> None:
        if not hasattr(self, "cache"):
            return
        # vLLM-format block events: replayed per tier, exactly the pages there, a namespace's
        # pages chained from the namespace (so equal tokens of two salts are different blocks) and
        # stored without their token ids (the shared cache's with them).
        for event in self.block_events.take_blocks():
            if event[0] == "AllBlocksCleared":
                self.published = {"GPU": set(), "CPU": set()}
            elif event[0] == "BlockStored":
                _, hashes, _, tokens, medium = event
                assert len(tokens) in (0, len(hashes) * self.page)
                self.token_less.update((h, not tokens) for h in hashes)
                assert not self.published[medium] & set(hashes), "a block stored twice"
                self.published[medium] |= set(hashes)
            else:
                _, hashes, medium = event
                assert set(hashes) <= self.published[medium], "a block removed that was never stored"
                self.published[medium] -= set(hashes)
        held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        stack = [(self.cache.root, None, False)]
        while stack:
            node, parent_hash, salted = stack.pop()
            for child in node.children.values():
                if child.namespace is not None:
                    stack.append((child, namespace_page_parent(child.namespace), True))
                    continue
                hashes = page_hashes(child.key, self.page, parent_hash)
                assert all(self.token_less.get(h, salted) == salted for h in hashes), \
                    "a salted block published with its token ids, or a shared one without"
                if child.value is not None:
                    held["GPU"] |= set(hashes)
                if child.host is not None:
                    held["CPU"] |= set(hashes)
                stack.append((child, hashes[-1], salted))
        assert self.published == held
        # /kv_events: the hashes replay to the tree's blocks, and a router's mirror of them finds
        # for each waiting request, keyed by its salt, the whole blocks the cache finds.
        for _, kind, hashes in self.hash_events.take_hashes():
            if kind == "insert":
                self.mirror |= set(hashes)
            elif kind == "evict":
                self.mirror -= set(hashes)
            else:
                self.mirror = set()
        assert self.mirror == set(self.hash_events.snapshot()["blocks"])
        mirror = BlockHashMirror()
        mirror.load(HASH_BLOCK, list(self.mirror))
        self.waiting.refresh()
        for req in self.waiting:
            salt = self.salts[req.cache_namespace]
            body = {"input_ids": req.match_target(), **({"cache_salt": salt} if salt else {})}
            key = routing_keys("/generate", body).tokens
            reusable = self.cache.reusable_len(req.match_target(), namespace=req.cache_namespace)
            assert req.peek_len <= reusable
            assert mirror.match_len(key) == reusable // HASH_BLOCK * HASH_BLOCK, "the router's view differs"

PrefixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_prefix_caches_driven_as_the_scheduler_drives_them = PrefixCacheMachine.TestCase


def _protocol_members() -> dict[str, object]:
    """The scheduler's protocol and what the engine asks besides (OwnedPrefixCache extends it)."""
    members = {}
    for cls in reversed(OwnedPrefixCache.__mro__):
        for name, value in vars(cls).items():
            if not name.startswith("_") and cls is not object and cls.__module__ == PrefixCache.__module__:
                members[name] = value
        if cls.__module__ == PrefixCache.__module__:
            members.update({name: None for name in vars(cls).get("__annotations__", {})})
    return members


# The protocol's parts (PrefixCache attributes) and the protocol each implements.
PARTS = {"memory": CacheMemory, "waiting": WaitingView, "conversations": Conversations}


def _check_members(obj: object, protocol: type, declared_members: dict[str, object]) -> None:
    for name, declared in declared_members.items():
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {protocol.__name__}.{name}"
        if inspect.isfunction(declared):
            want = list(inspect.signature(declared).parameters)[1:]
            got = list(inspect.signature(getattr(obj, name)).parameters)
            assert got == want, f"{type(obj).__name__}.{name}{got} is not the protocol's {want}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_implements_the_whole_protocol_with_its_signatures(kind: str) -> None:
    pool = KVPool(16, 1, 1, 1, 2, torch.float32, "cpu")
    cache = make_cache(kind, pool, host_tokens=16)
    assert isinstance(cache, OwnedPrefixCache)
    _check_members(cache, OwnedPrefixCache, _protocol_members())
    for part, protocol in PARTS.items():
        members = {name: value for name, value in vars(protocol).items() if not name.startswith("_")}
        members.update({name: None for name in vars(protocol).get("__annotations__", {})})
        _check_members(getattr(cache, part), protocol, members)


def test_the_cache_that_keeps_nothing_frees_a_leaving_requests_slots_and_reports_no_hit() -> None:
    pool = KVPool(16, 2, 1, 1, 2, torch.float32, "cpu")
    cache = NoPrefixCache(pool.allocator, page_size=2)
    kv = KVManager(cache, ReqToTokenPool(2, 32, "cpu"))
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    for i in range(3):  # the same prompt each time: never found
        req = Req(rid=str(i), origin_input_ids=list(range(9)), sampling_params=params, arrival_time=0.0,
                  arrival_seq=i)
        req.req_pool_idx = kv.req_to_token.alloc()
        kv.lock_prefix(req, cache.admit(req, room=0, spare_only=False))
        assert req.locked_len == 0
        assert kv.grow(req, 5) and len(req.slots) == 6
        kv.cache_req(req, finished=False)  # a finished chunk: the request keeps its slots
        assert req.locked_len == 0 and len(req.slots) == 6 and pool.allocator.free_tokens == 10
        assert kv.grow(req, 9)
        kv.check_invariants([req])
        kv.cache_req(req, finished=True)
        assert pool.allocator.free_tokens == 16 and cache.peek(list(range(9))) == (0, cache.root)
        kv.check_invariants([])
    assert cache.flush() and cache.evict(100) == 0 and cache.tier_stats()["host_pool_tokens"] == 0
