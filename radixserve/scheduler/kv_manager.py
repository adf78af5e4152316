"""What a request holds of the KV memory, and the one way it gives it back.

A running request owns a row of req_to_token, holds the tree path of its cached prefix locked
(`Req.locked_len` positions, through `Req.last_node`) and owns the slots after it. `cache_req`
returns computed KV to the tree: for a finished chunk (the request keeps running on the tree's
copy) and for a request that leaves (finished, aborted, retracted, or un-admitted).

The row is also the request's row of whatever state the cache keeps beyond KV (`cache.states`):
the cache puts the state its match needs there when it locks the prefix (`Admission.lock`), is
told when a scheduled piece reaches one of the request's chunk ends (`take_state`), and hangs what
it took on the tree with the KV (`keep_states`). A cache of KV alone has no `states`.
"""

from __future__ import annotations

import torch

from radixserve.cache.admission import Admission
from radixserve.cache.kv_pool import PageAllocator, ReqToTokenPool, TableWrites, int64_tensor
from radixserve.cache.prefix_cache import PrefixCache
from radixserve.scheduler.request import Req


class KVManager:
    def __init__(self, cache: PrefixCache, req_to_token: ReqToTokenPool):
        self.cache = cache
        self.allocator: PageAllocator = cache.allocator
        self.page_size = cache.allocator.page_size
        self.req_to_token = req_to_token
        # Device table writes collected during scheduling, applied in one operation per step.
        self._writes = TableWrites()

    # ------------------------------------------------------------------ arithmetic
    def page_ceil(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def page_floor(self, n: int) -> int:
        return n - n % self.page_size

    @property
    def available_tokens(self) -> int:
        """Slots free now or after evicting every unlocked tree node."""
        return self.allocator.free_tokens + self.cache.memory.evictable

    def ensure_free(self, tokens: int) -> bool:
        short = tokens - self.allocator.free_tokens
        if short > 0:
            self.cache.evict(short)
        return self.allocator.free_tokens >= tokens

    # ------------------------------------------------------------------ taking memory
    def lock_prefix(self, req: Req, admission: Admission, *, branch_at: int = 0) -> None:
        """Lock the cached prefix of req (whose row is set) through the cache's admission of it
        (PrefixCache.admit) and point its row at the prefix's slots. branch_at: how far a waiting
        request shares its prompt (Admission.lock)."""
        match = admission.lock(req.req_pool_idx, branch_at=branch_at)
        req.admission, req.chunk_ends = admission, admission.chunk_ends
        req.last_node = match.last_node
        req.locked_len = match.length
        req.slots = match.slots.tolist()
        req.kv_len = match.length
        self._writes.add_run(req.req_pool_idx, 0, match.slots)  # the row may hold a previous request's slots

    def unlock_prefix(self, req: Req) -> None:
        """Undo `lock_prefix` for a request that is not run after all: it holds nothing again."""
        req.admission.cancel()
        self._drop(req)

    def grow(self, req: Req, upto: int) -> bool:
        """Give req slots for positions up to `upto`; False (nothing taken) when memory is short."""
        have = self.page_ceil(req.kv_len)
        need_pages = (self.page_ceil(upto) - have) // self.page_size
        if need_pages > 0:
            if not self.ensure_free(need_pages * self.page_size):
                return False
            pages = self.allocator.alloc_pages(need_pages)
            assert pages is not None
            slots = self._slots_of(pages)
            req.slots.extend(slots)
            self._writes.add_run(req.req_pool_idx, have, slots)
        req.kv_len = upto
        if upto in req.chunk_ends:
            self.cache.states.take_state(req.req_pool_idx, upto)  # only a cache keeping states asks for chunk ends
        return True

    def capture_states(self, req: Req, start: int, end: int) -> list[tuple[int, int]]:
        """After `grow(req, end)` for a piece [start, end) that will run: the (position, snapshot
        slot) pairs whose states its forward pass writes on the way (RequestStates.capture_states)."""
        states = self.cache.states
        return states.capture_states(req.req_pool_idx, start, end) if states is not None else []

    def grow_decoding(self, reqs: list[Req]) -> list[int]:
        """One more position for each request; the memory must have been ensured. Returns each
        request's new position (its kv_len before). One allocation for every request that starts
        a new page; at page size 1 (every request does) the table writes are queued as one
        extension per list, since this runs for every decoding request every step."""
        positions = [r.kv_len for r in reqs]
        ps = self.page_size
        if ps == 1:
            slots = self.allocator.alloc_pages(len(reqs))
            assert slots is not None, "decode memory is ensured before it is taken"
            # A request has one slot per position at page size 1.
            self._writes.add_singles([r.req_pool_idx for r in reqs], positions, slots)
            for req, slot in zip(reqs, slots):
                req.slots.append(slot)
                req.kv_len += 1
            return positions
        growing = [r for r in reqs if r.kv_len % ps == 0]
        if growing:
            pages = self.allocator.alloc_pages(len(growing))
            assert pages is not None, "decode memory is ensured before it is taken"
            all_slots = self._slots_of(pages)
            for i, req in enumerate(growing):
                slots = all_slots[i * ps:(i + 1) * ps]
                self._writes.add_run(req.req_pool_idx, len(req.slots), slots)
                req.slots.extend(slots)
        for req in reqs:
            req.kv_len += 1
        return positions

    def shrink(self, req: Req, upto: int) -> None:
        """Take back req's positions from `upto` on, with the pages only they used (a step that
        was scheduled but could not run)."""
        keep = self.page_ceil(upto)
        self._free_slots(req.slots[keep:])
        del req.slots[keep:]
        req.kv_len = upto

    def _slots_of(self, pages: list[int]) -> list[int]:
        """The KV slots of these pages, page by page (a page is its slot at page size 1)."""
        return self.allocator.pages_to_slots(pages).tolist() if self.page_size > 1 else pages

    # ------------------------------------------------------------------ giving it back
    def cache_req(self, req: Req, *, finished: bool, readmitted: bool = False) -> None:
        """Put what the cache takes of req's computed KV (its whole pages) into the cache.
        finished: req gives back everything it holds (lock, slots, row) and leaves the pool;
        readmitted: it waits to be admitted again (a hybrid's cache keeps its state for it).
        Otherwise it keeps running on the cache's copy of those pages, locked up to their end (a
        finished prefill chunk); a cache that takes nothing leaves the chunk's slots with req."""
        n = self.cache.insertable_len(req.kv_len)
        if not finished and n <= req.locked_len:
            return  # nothing new the cache takes
        tokens = req.fill_ids[:n]
        already = self.cache.insert(tokens, req.slots[:n], namespace=req.cache_namespace)
        # A leaving request's row holds the state after all its kv_len positions.
        if self.cache.states is not None:
            self.cache.states.keep_states(req.req_pool_idx, tokens, namespace=req.cache_namespace,
                                          state_len=req.kv_len if finished else None, readmitted=readmitted)
        self._free_slots(req.slots[req.locked_len:already])  # duplicates of tokens cached meanwhile
        if finished:
            self._free_slots(req.slots[n:])  # the partly filled last page
            self.cache.unlock(req.last_node)
            self._drop(req)
            return
        self.cache.unlock(req.last_node)
        match = self.cache.match(tokens, namespace=req.cache_namespace, kv_only=True)
        assert match.length == n
        self.cache.lock(match.last_node)
        if already > req.locked_len:  # take the tree's copies of the duplicated positions
            tree_slots = match.slots[req.locked_len:already].tolist()
            req.slots[req.locked_len:already] = tree_slots
            self._writes.add_run(req.req_pool_idx, req.locked_len, tree_slots)
        req.last_node, req.locked_len = match.last_node, n

    def _drop(self, req: Req) -> None:
        req.slots, req.last_node, req.locked_len, req.kv_len, req.chunk_ends = [], None, 0, 0, ()
        req.admission = None
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx = None

    def _free_slots(self, slots: list[int]) -> None:
        if slots:
            self.allocator.free_slots(int64_tensor(slots))

    # ------------------------------------------------------------------ the device table
    def flush_table_writes(self) -> None:
        if self._writes:
            self.req_to_token.write(self._writes)
            self._writes = TableWrites()

    # ------------------------------------------------------------------ accounting
    @staticmethod
    def owned_tokens(reqs: list[Req]) -> int:
        """Slots these requests own outside the tree."""
        return sum(len(r.slots) - r.locked_len for r in reqs)

    def check_invariants(self, running: list[Req]) -> None:
        owned = [torch.tensor(r.slots[r.locked_len:], dtype=torch.int64) for r in running]
        self.cache.memory.check(self.owned_tokens(running), owned, [r.req_pool_idx for r in running])
