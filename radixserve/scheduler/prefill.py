"""Prefill admission for one step: the token budget, the memory left for new requests, and adding
a request's next prompt piece to the batch (`PrefillAdder.try_add_one`).

Memory arithmetic: a running request is expected to still need the rest of its prompt plus a
share (`new_token_ratio`) of its remaining output tokens; a new request is admitted only if its
prompt and its own share fit in what is free or evictable after those reservations. Locking a
request's cached prefix makes those tree tokens unevictable, so they leave the available memory
too (`locked_away`). While the pool is busy, tree tokens that waiting requests will reuse do not
count as evictable either (`CacheMemory.reclaimable`).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from radixserve.cache.admission import Admission
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.request import Req

# The future decode tokens reserved for a request are clipped, so one request asking for a huge
# max_new_tokens cannot block admission.
CLIP_MAX_NEW_TOKENS = 4096
# Prompt log probabilities need the logits of every position they score ([rows, vocab] in fp32:
# 0.6 GB per 1,024 rows at a 152k vocabulary); a step computes at most this many such rows, so the
# start-up memory plan can measure the largest step (radixserve.engine.memory_plan).
PROMPT_LOGPROB_ROWS_PER_STEP = 1024


def decode_reserve(new_tokens: int, new_token_ratio: float) -> int:
    """The share of `new_tokens` output tokens still to come that admission keeps memory for."""
    return math.ceil(min(max(new_tokens, 0), CLIP_MAX_NEW_TOKENS) * new_token_ratio)


def reserved_decode_tokens(req: Req, new_token_ratio: float) -> int:
    """The share of req's remaining output tokens that admission keeps memory for."""
    return decode_reserve(req.remaining_new_tokens(), new_token_ratio)


def future_tokens(req: Req, new_token_ratio: float) -> int:
    """Tokens a running request is expected to still need: the rest of its prompt plus a share of its output."""
    return max(0, req.seq_len - req.kv_len - 1) + reserved_decode_tokens(req, new_token_ratio)


class PrefillAdder:
    def __init__(self, kv: KVManager, batch: ScheduledBatch, *, budget: int, chunking: bool,
                 new_token_ratio: float, min_shared_prefix: int):
        self.kv = kv
        self.batch = batch
        self.budget = budget  # prompt tokens this step may still compute
        self.chunking = chunking
        self.new_token_ratio = new_token_ratio
        self.min_shared_prefix = min_shared_prefix
        self.available = 0  # tokens new requests may still take (see reserve_for)
        self.prompt_logprob_rows = PROMPT_LOGPROB_ROWS_PER_STEP  # still allowed this step
        self.spare_waited = True  # whether tree tokens waiting requests will reuse count as spare

    def reserve_for(self, running: list[Req], *, spare_waited: bool) -> None:
        """Start admitting: what is free or evictable, less what running requests will need.
        spare_waited: prefixes waiting requests will reuse may be evicted for new requests."""
        self.spare_waited = spare_waited
        future = sum(future_tokens(r, self.new_token_ratio) for r in running)
        self.available = self.kv.allocator.free_tokens + self._spare() - future

    def _spare(self) -> int:
        """Tree tokens admission may evict."""
        memory = self.kv.cache.memory
        return memory.evictable if self.spare_waited else memory.reclaimable

    def completes(self, req: Req) -> bool:
        """Whether a waiting request's uncached prompt fits whole in what is left of the budget."""
        return req.seq_len - req.peek_len <= self.budget

    def add_chunk(self, req: Req) -> int:
        """The next piece of a running request's chunked prompt; returns the tokens taken."""
        return self._add_piece(req, new=False)

    def continuation_key(self, req: Req) -> tuple:
        """The in-batch sharing key (`defers`) of what a running request mid-prompt computes next:
        a waiting request with the same key would compute those tokens again beside it, so it waits
        for them to be cached instead (its match ends where this request's cached chunks end, and
        its next tokens are this request's)."""
        start = req.locked_len
        return (id(req.last_node), req.cache_namespace, start,
                tuple(req.fill_ids[start:start + self.min_shared_prefix]))

    def defers(self, req: Req, in_flight_keys: set[tuple], *, record: bool = True) -> bool:
        """In-batch prefix sharing: two requests share an uncached prefix of >= min_shared_prefix
        tokens exactly when their cached match has the same length and node and the next
        min_shared_prefix tokens agree. The first is admitted (its key recorded even if admission
        then fails; not at all with record=False); the rest wait and find the prefix cached once
        that step is collected. Not where the cache would keep nothing of what the first computes
        beyond the match (no cache, or less than a page): the rest would find nothing more and only
        have waited."""
        start = req.peek_len
        if req.seq_len - start <= self.min_shared_prefix or self.kv.cache.insertable_len(req.seq_len) <= start:
            return False
        shared = tuple(req.fill_ids[start:start + self.min_shared_prefix])
        key = (id(req.peek_node), req.cache_namespace, start, shared)
        if key in self.batch.shared_prefix_keys or key in in_flight_keys:
            return True
        if record:
            self.batch.shared_prefix_keys.add(key)
        return False

    def try_add_one(self, req: Req, admission: Admission, *, alone: bool, branch_at: int = 0) -> bool:
        """Give a waiting request a row, lock its cached prefix (through the cache's admission of
        it) and add its first prompt piece if its memory fits (alone: nothing else runs, so its
        prompt alone must fit; branch_at: how far a waiting request shares its prompt). On False
        it holds nothing."""
        req.req_pool_idx = self.kv.req_to_token.alloc()
        spare_before = self._spare()
        self.kv.lock_prefix(req, admission, branch_at=branch_at)
        locked_away = spare_before - self._spare()  # cached tokens now protected
        prompt_left = self.kv.page_ceil(req.seq_len - req.kv_len)
        need = prompt_left + reserved_decode_tokens(req, self.new_token_ratio)
        room = self.available - locked_away
        fits = need <= room or (alone and prompt_left <= self.kv.available_tokens)
        if not fits or not self._add_piece(req, new=True):
            self.kv.unlock_prefix(req)
            return False
        self.available -= locked_away + need
        return True

    def _add_piece(self, req: Req, *, new: bool) -> int:
        """Schedule the next piece of req's prompt; returns the tokens taken (0: not scheduled)."""
        todo = req.seq_len - req.kv_len
        n = min(todo, self.budget) if self.chunking else todo
        for end in req.chunk_ends:  # the cache keeps the state there: a piece ends at it, chunking or not
            if end > req.kv_len:
                n = min(n, end - req.kv_len)
                break
        first_scored = req.prompt_logprobs_from
        if first_scored is not None and self.chunking:
            n = min(n, max(first_scored - req.kv_len, 0) + self.prompt_logprob_rows)
        if n <= 0:
            return 0
        if not self.chunking and new and self.batch.num_new_tokens > 0 and n > self.budget:
            return 0  # without chunking, a prompt over budget runs only as the first of a step
        before = req.kv_len
        if not self.kv.grow(req, before + n):
            return 0
        if new:
            self.batch.num_new_seqs += 1
            self.batch.num_cached_tokens += req.locked_len
        self.batch.add(req, before, n, before + n == req.seq_len)
        index = len(self.batch.reqs) - 1
        self.batch.state_captures.extend((index, position - before, slot)
                                         for position, slot in self.kv.capture_states(req, before, before + n))
        if first_scored is not None:
            self.prompt_logprob_rows -= len(req.prompt_logprob_positions(before, before + n))
        self.batch.num_new_tokens += n
        self.budget -= n
        return n


class QueueRoom:
    """Room in the running batch between two steps, filled by waiting requests in arrival order:
    what `--max-queued-requests` does not count as queued. A request fits with a free request slot
    and the KV its prompt and its share of output tokens need (admission's own reservation),
    after what the running requests still need (their next positions and their share), so an
    idle server takes a burst it can run however many arrive within one step."""

    def __init__(self, kv: KVManager, running: list[Req], waiting: Iterable[Req], *, rows: int,
                 new_token_ratio: float):
        self.ratio = new_token_ratio
        self.rows = rows
        # Between steps a decoding request's next position has no slot yet: it counts too.
        running_need = sum(r.remaining + reserved_decode_tokens(r, self.ratio) for r in running)
        self.tokens = kv.available_tokens - running_need
        self.fitted = 0
        for req in waiting:
            if self.rows <= 0:
                break
            self.take(req.seq_len, req.remaining_new_tokens())

    def take(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Reserve room for one request; False (nothing reserved) when the batch is full."""
        need = prompt_tokens + decode_reserve(max_new_tokens, self.ratio)
        if self.rows <= 0 or need > self.tokens:
            return False
        self.rows -= 1
        self.tokens -= need
        self.fitted += 1
        return True

    def admits(self, prompt_tokens: int, max_new_tokens: int, waiting: int, limit: Optional[int]) -> bool:
        """Whether a new request may join the `waiting` requests under the queue limit."""
        if self.take(prompt_tokens, max_new_tokens):
            return True
        return limit is None or waiting - self.fitted < limit
