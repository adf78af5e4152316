"""Continuous batching over the radix cache: admission, chunked prefill, decode and retraction.

Every step builds one batch: one new token for each decoding request, plus prompt pieces of
waiting requests admitted in policy order within the prefill budget. A request holds the tree
path of its cached prefix locked and owns the slots of everything after it; finished chunks and
finished requests go back into the tree, so the next request with the same prefix finds them.

Overlap: the engine may build step N+1 before the tokens of step N are known (`Req.pending`
counts them). Everything here then works on positions, not token values; the only decisions that
need the values (stop tokens, stop strings) are taken when the results arrive, one step late, and
a request that finished at step N has its step N+1 token dropped. Retraction is the one thing
that is never done with results outstanding: the scheduler raises `NeedResults` instead, and the
engine waits for the step in flight and schedules again.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from radixserve.cache.kv_pool import PageAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache, TreeNode
from radixserve.scheduler.request import Req, ReqState
from radixserve.scheduler.waiting_queue import WaitingQueue
from radixserve.settings import ServerSettings

# The future decode tokens a running request is assumed to need are clipped, so one request
# asking for a huge max_new_tokens cannot block admission, and scaled by an adaptive ratio:
# it decays while decoding goes well and jumps back up when a retraction shows it was too low.
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class NeedResults(Exception):
    """Scheduling needs the results of the step in flight first (it would have to retract)."""


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    prefix_lens: list[int]  # KV positions computed before this step
    extend_lens: list[int]  # new positions computed in this step
    sample: list[bool]  # whether the request samples a token after this step
    num_new_seqs: int = 0
    num_new_tokens: int = 0  # prompt tokens computed for admitted / chunked requests
    num_cached_tokens: int = 0  # prompt tokens of new admissions found in the cache

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.extend_lens) and self.num_new_tokens == 0


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_steps: int = 0
    num_decode_steps: int = 0
    admitted: int = 0
    in_batch_deferrals: int = 0


class Scheduler:
    def __init__(self, settings: ServerSettings, cache: RadixCache, req_to_token: ReqToTokenPool, *,
                 context_len: int, eos_token_ids: list[int], decode_text: Optional[Callable[[list[int]], str]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.cache = cache
        self.allocator: PageAllocator = cache.allocator
        self.page_size = cache.page_size
        self.req_to_token = req_to_token
        self.context_len = context_len
        self.eos_token_ids = set(eos_token_ids)
        self.decode_text = decode_text
        self.clock = clock
        self.max_running = min(settings.max_running_requests or req_to_token.max_requests, req_to_token.max_requests)
        self.waiting = WaitingQueue(cache, settings.schedule_policy,
                                    max_overtake_s=settings.lpm_max_overtake_s,
                                    seed=settings.random_seed)
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        # SGLang's --schedule-conservativeness: scales how many future decode tokens are reserved.
        self._ratio_scale = settings.schedule_conservativeness
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * self._ratio_scale
        self.stats = SchedulerStats()
        self._arrivals = 0
        # Device table writes collected during scheduling, applied in one operation per step.
        self._pending_rows: list[int] = []
        self._pending_cols: list[int] = []
        self._pending_slots: list[int] = []
        # Set by the engine while a step's results are outstanding (overlap scheduling).
        self.results_outstanding = False
        # In-batch sharing keys of the prefixes admitted by the last scheduled step.
        self._prefixes_in_flight: set[tuple] = set()
        # Prefixes of finished requests held for --prefix-hold-s: (release time, node), oldest first.
        self._held: deque[tuple[float, TreeNode]] = deque()

    def reset_stats(self) -> None:
        """Forget what earlier requests taught (after the engine's warm-up)."""
        self.stats = SchedulerStats()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * self._ratio_scale

    # ------------------------------------------------------------------ intake
    def add_request(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        self.reqs[req.rid] = req
        self.waiting.add(req)

    def abort(self, rid: str) -> Optional[Req]:
        """Stop a request wherever it is; its computed KV stays in the tree. Returns it, if known."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        if req.state is ReqState.WAITING:
            self.waiting.remove(req)
        elif req.state is ReqState.RUNNING:
            self.running.remove(req)
            self._release(req)
        req.finish_reason = {"type": "abort", "message": "aborted"}
        req.state = ReqState.FINISHED
        del self.reqs[rid]
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ------------------------------------------------------------------ memory helpers
    def _page_ceil(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _page_floor(self, n: int) -> int:
        return n - n % self.page_size

    def _ensure_free(self, tokens: int) -> bool:
        short = tokens - self.allocator.free_tokens
        if short > 0:
            self.cache.evict(short)
        return self.allocator.free_tokens >= tokens

    def _grow(self, req: Req, upto: int) -> bool:
        """Give req slots for positions up to `upto`; False (nothing taken) when memory is short."""
        have = self._page_ceil(req.kv_len)
        need_pages = (self._page_ceil(upto) - have) // self.page_size
        if need_pages > 0:
            if not self._ensure_free(need_pages * self.page_size):
                return False
            pages = self.allocator.alloc_pages(need_pages)
            assert pages is not None
            slots = self._slots_of(pages)
            req.slots.extend(slots)
            self._queue_table_write(req.req_pool_idx, have, slots)
        req.kv_len = upto
        return True

    def _slots_of(self, pages: list[int]) -> list[int]:
        """The KV slots of these pages, page by page (a page is its slot at page size 1)."""
        return self.allocator.pages_to_slots(pages).tolist() if self.page_size > 1 else pages

    def _queue_table_write(self, row: int, start: int, slots: list[int]) -> None:
        self._pending_rows.extend([row] * len(slots))
        self._pending_cols.extend(range(start, start + len(slots)))
        self._pending_slots.extend(slots)

    def flush_table_writes(self) -> None:
        if self._pending_slots:
            self.req_to_token.write(self._pending_rows, self._pending_cols, self._pending_slots)
            self._pending_rows, self._pending_cols, self._pending_slots = [], [], []

    def held_by_running(self) -> int:
        return sum(len(r.slots) - r.prefix_len for r in self.running)

    def running_owned_slots(self) -> list[torch.Tensor]:
        return [torch.tensor(r.slots[r.prefix_len:], dtype=torch.int64) for r in self.running]

    def check_invariants(self) -> None:
        self.cache.check_invariants(self.held_by_running(), self.running_owned_slots())
        self._check_waiter_counts()

    def _check_waiter_counts(self) -> None:
        """Each node's waiter count is the waiting requests parked at or below it plus held prefixes."""
        expected: Counter = Counter()
        for node in [r.peek_node for r in self.waiting] + [node for _, node in self._held]:
            while node is not None and node.parent is not None:
                expected[node] += 1
                node = node.parent
        for node in self.cache.iter_nodes():
            assert node.waiters == expected[node], f"{node}: {node.waiters} waiters, expected {expected[node]}"

    # ------------------------------------------------------------------ prefix hold
    def _hold_prefix(self, req: Req) -> None:
        """Keep a finished request's prefix out of eviction and admission for --prefix-hold-s: under
        pressure, a conversation's next turn otherwise finds it evicted by a request that arrived
        during the turn's think time."""
        if self.settings.prefix_hold_s <= 0 or self.cache.disabled:
            return
        _, node = self.cache.peek(req.fill_ids)
        if node is not self.cache.root:
            self.cache.add_waiter(node)
            self._held.append((self.clock() + self.settings.prefix_hold_s, node))

    def _release_expired_holds(self) -> None:
        now = self.clock()
        while self._held and self._held[0][0] <= now:
            self.cache.remove_waiter(self._held.popleft()[1])

    def _future_tokens(self, req: Req) -> int:
        """Tokens req is expected to still need: the rest of its prompt plus a share of its output."""
        decode = min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
        return max(0, req.seq_len - req.kv_len - 1) + math.ceil(decode)

    # ------------------------------------------------------------------ lock bookkeeping
    def _lock_prefix(self, req: Req) -> None:
        match = self.cache.match(req.match_target())
        self.cache.inc_lock(match.last_node)
        req.last_node = match.last_node
        req.prefix_len = match.length
        req.slots = match.slots.tolist()
        req.kv_len = match.length
        if req.slots:  # the row may hold a previous request's slots
            self._queue_table_write(req.req_pool_idx, 0, req.slots)

    def _release(self, req: Req) -> None:
        """Give back what req holds: its computed KV goes into the tree, the rest is freed."""
        row = req.req_pool_idx
        if self.cache.disabled:
            self._free_slot_list(req.slots)
        else:
            n = self._page_floor(req.kv_len)
            already = self.cache.insert(req.fill_ids[:n], torch.tensor(req.slots[:n], dtype=torch.int64))
            self._free_slot_list(req.slots[req.prefix_len:already])  # duplicates of cached tokens
            self._free_slot_list(req.slots[n:])  # the partly filled last page
            self.cache.dec_lock(req.last_node)
        req.slots, req.last_node, req.prefix_len, req.kv_len = [], None, 0, 0
        self.req_to_token.free(row)
        req.req_pool_idx = None

    def _free_slot_list(self, slots: list[int]) -> None:
        if slots:
            self.allocator.free_slots(torch.tensor(slots, dtype=torch.int64))

    def _cache_finished_chunk(self, req: Req) -> None:
        """Put the chunks computed so far into the tree and lock them, keeping req running."""
        if self.cache.disabled:
            return
        n = self._page_floor(req.kv_len)
        if n <= req.prefix_len:
            return
        already = self.cache.insert(req.fill_ids[:n], torch.tensor(req.slots[:n], dtype=torch.int64))
        self._free_slot_list(req.slots[req.prefix_len:already])
        self.cache.dec_lock(req.last_node)
        match = self.cache.match(req.fill_ids[:n])
        assert match.length == n
        self.cache.inc_lock(match.last_node)
        if already > req.prefix_len:  # take the tree's copies of the duplicated positions
            tree_slots = match.slots[req.prefix_len:already].tolist()
            req.slots[req.prefix_len:already] = tree_slots
            self._queue_table_write(req.req_pool_idx, req.prefix_len, tree_slots)
        req.last_node, req.prefix_len = match.last_node, n

    # ------------------------------------------------------------------ retraction
    def _retract_one(self, candidates: list[Req]) -> Req:
        # Cheapest to redo: least decoded output, then the longest prompt (most KV freed, and the
        # prompt part is likely still cached when it comes back).
        victim = min(candidates, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        candidates.remove(victim)
        self.running.remove(victim)
        self._release(victim)
        victim.state = ReqState.WAITING
        victim.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.add(victim)
        self.new_token_ratio = min(1.0, max(INIT_NEW_TOKEN_RATIO * self._ratio_scale, self.new_token_ratio * 1.5))
        return victim

    # ------------------------------------------------------------------ the step
    def schedule(self) -> Optional[ScheduledBatch]:
        self._release_expired_holds()
        self.waiting.refresh()
        batch = ScheduledBatch([], [], [], [])
        self._schedule_decode(batch)
        self._schedule_prefill(batch)
        self.stats.num_steps += 1
        if not batch.reqs:
            return None
        if batch.is_decode_only:
            self.stats.num_decode_steps += 1
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO * self._ratio_scale,
                                       self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self.flush_table_writes()
        for req, samples in zip(batch.reqs, batch.sample):
            if samples:
                req.pending += 1
        return batch

    def _finishes_by_length(self, req: Req) -> bool:
        """True when a token still on the device is req's last: no step after it is needed."""
        return req.pending > 0 and (req.num_generated >= req.sampling_params.max_new_tokens
                                    or req.seq_len >= self.context_len)

    def _schedule_decode(self, batch: ScheduledBatch) -> None:
        decoding = [r for r in self.running if r.remaining == 1 and not self._finishes_by_length(r)]
        ps = self.page_size
        while decoding:
            new_pages = sum(1 for r in decoding if r.kv_len % ps == 0)
            if self._ensure_free(new_pages * ps):
                break
            if len(decoding) == 1 and len(self.running) == 1:
                break  # validated at intake: a lone request always fits once everything else is evicted
            if self.results_outstanding:
                raise NeedResults()
            self._retract_one(decoding)
        # One allocation for every request that starts a new page (one per request at page size 1).
        growing = [r for r in decoding if r.kv_len % ps == 0]
        if growing:
            pages = self.allocator.alloc_pages(len(growing))
            assert pages is not None, "decode memory was ensured above"
            all_slots = self._slots_of(pages)
            for i, req in enumerate(growing):
                slots = all_slots[i * ps:(i + 1) * ps]
                self._queue_table_write(req.req_pool_idx, len(req.slots), slots)
                req.slots.extend(slots)
        for req in decoding:
            prefix = req.kv_len
            req.kv_len = prefix + 1
            batch.reqs.append(req)
            batch.prefix_lens.append(prefix)
            batch.extend_lens.append(1)
            batch.sample.append(True)

    def _prefill_budget(self) -> int:
        s = self.settings
        if s.chunked_prefill_size > 0:
            return min(s.max_prefill_tokens, s.chunked_prefill_size)
        return s.max_prefill_tokens

    def _schedule_prefill(self, batch: ScheduledBatch) -> None:
        budget = self._prefill_budget()
        chunking = self.settings.chunked_prefill_size > 0
        # A request in the middle of a chunked prefill continues first.
        for req in [r for r in self.running if r.remaining > 1]:
            budget -= self._add_prefill(batch, req, budget, chunking, new=False)
        # Prefixes admitted by the step in flight are not in the tree yet either.
        in_flight = self._prefixes_in_flight if self.results_outstanding else set()
        self._prefixes_in_flight = admitted = set()
        if budget <= 0 or not len(self.waiting):
            return
        if not all(batch.sample):
            return  # a request is still mid-prompt: finish it before admitting more
        # Queue-aware admission: while running requests fill half the pool, prefixes that waiting
        # requests (or a held, just-finished conversation) will reuse are no room for a new request;
        # below that, a full batch comes first.
        busy = self.cache.protected_size + self.held_by_running() >= self.allocator.total_tokens // 2
        spare = (lambda: self.cache.reclaimable_size) if busy else (lambda: self.cache.evictable_size)
        future = sum(self._future_tokens(r) for r in self.running)
        available = self.allocator.free_tokens + spare() - future
        min_shared = self.settings.in_batch_prefix_min_len
        for req in self.waiting.ordered():
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if self.req_to_token.free_rows == 0:
                break
            # In-batch prefix sharing: two requests share an uncached prefix of >= min_shared
            # tokens exactly when their cached match has the same length and node and the next
            # min_shared tokens agree. Admit the first; the rest find it cached next step.
            if not self.cache.disabled and req.seq_len - req.peek_len > min_shared:
                key = (id(req.peek_node), req.peek_len, tuple(req.fill_ids[req.peek_len:req.peek_len + min_shared]))
                if key in admitted or key in in_flight:
                    self.stats.in_batch_deferrals += 1
                    continue
                admitted.add(key)
            self.waiting.remove(req)
            req.req_pool_idx = self.req_to_token.alloc()
            spare_before = spare()
            self._lock_prefix(req)
            locked_away = spare_before - spare()  # cached tokens now protected
            need = self._page_ceil(req.seq_len - req.kv_len) + math.ceil(
                min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
            alone = not self.running and not batch.reqs
            fits = need <= available - locked_away or (
                alone and self._page_ceil(req.seq_len - req.kv_len)
                <= self.allocator.free_tokens + self.cache.evictable_size)
            taken = self._add_prefill(batch, req, budget, chunking, new=True) if fits else 0
            if not taken:
                self._unadmit(req)
                break
            available -= locked_away + need
            budget -= taken
            if not batch.sample[-1]:
                break  # it became the chunked request: one at a time

    def _unadmit(self, req: Req) -> None:
        self.cache.dec_lock(req.last_node)
        self._free_slot_list(req.slots[req.prefix_len:])
        req.slots, req.last_node, req.prefix_len, req.kv_len = [], None, 0, 0
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx = None
        self.waiting.add(req)

    def _add_prefill(self, batch: ScheduledBatch, req: Req, budget: int, chunking: bool, *, new: bool) -> int:
        """Schedule the next piece of req's prompt; returns the tokens taken (0: not scheduled)."""
        todo = req.seq_len - req.kv_len
        n = min(todo, budget) if chunking else todo
        if n <= 0:
            return 0
        if not chunking and new and batch.num_new_tokens > 0 and n > budget:
            return 0  # without chunking, a prompt over budget runs only as the first of a step
        prefix = req.kv_len
        if not self._grow(req, prefix + n):
            return 0
        if new:
            if req.cached_tokens < 0:
                req.cached_tokens = req.prefix_len
                self.cache.counters.prompt_tokens += len(req.origin_input_ids)
                self.cache.counters.cached_prompt_tokens += min(req.prefix_len, len(req.origin_input_ids))
            req.state = ReqState.RUNNING
            req.admitted_time = req.admitted_time or self.clock()
            self.running.append(req)
            self.stats.admitted += 1
            batch.num_new_seqs += 1
            batch.num_cached_tokens += req.prefix_len
        batch.reqs.append(req)
        batch.prefix_lens.append(prefix)
        batch.extend_lens.append(n)
        batch.sample.append(prefix + n == req.seq_len)
        batch.num_new_tokens += n
        return n

    # ------------------------------------------------------------------ results
    def process_results(self, batch: ScheduledBatch, next_token_ids: list[int]) -> list[Req]:
        """Append sampled tokens, finish what is done; returns the requests with news for the caller."""
        now = self.clock()
        updated: list[Req] = []
        sampled = iter(next_token_ids)
        for req, samples, extend in zip(batch.reqs, batch.sample, batch.extend_lens):
            token = next(sampled) if samples else None
            if req.state is not ReqState.RUNNING:
                continue  # finished or aborted after this step was built: its token is dropped
            if samples:
                req.pending -= 1
                req.output_ids.append(token)
            if not samples or extend > 1:
                # A finished chunk or a just-finished prompt goes into the tree at once, so
                # requests sharing its prefix (deferred in-batch ones above all) find it cached.
                self._cache_finished_chunk(req)
            if not samples:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._finish_reason(req, token)
            if reason is not None:
                req.finish_reason = reason
                self.running.remove(req)
                self._release(req)
                self._hold_prefix(req)
                req.state = ReqState.FINISHED
                del self.reqs[req.rid]
            updated.append(req)
        if not self.has_work:
            self.check_invariants()  # cheap when idle, and it catches any leak at once
        return updated

    def _finish_reason(self, req: Req, token: int) -> Optional[dict]:
        params = req.sampling_params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if params.stop and self.decode_text is not None:
            longest = max(len(s) for s in params.stop)
            tail = self.decode_text(req.output_ids[-(longest + 8):])
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if (len(req.output_ids) >= params.max_new_tokens
                or len(req.origin_input_ids) + len(req.output_ids) >= self.context_len):
            return {"type": "length", "length": len(req.output_ids)}
        return None
