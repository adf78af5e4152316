"""Engine-process helpers for what enters and leaves the scheduler: the waiting-queue limit and
the radix cache's events as chained block hashes.

`QueueRoom` decides `--max-queued-requests`: a request counts as queued only when the running
batch has no room left for it (a free request slot and the KV its prompt and a share of its output
need), so an idle server admits a burst it can run however many arrive within one step.

`KvHashEvents` turns the cache's insert/evict/flush events into the hashes of whole token blocks
(`radixserve.cache.block_hash`): an insert publishes the blocks of the inserted path, an eviction
the blocks of the evicted path the tree no longer holds, so a mirror that adds and discards those
hashes holds exactly the tree's whole blocks. Token ids never leave the engine.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from radixserve.cache.block_hash import KV_HASH_BLOCK_TOKENS, ROOT_HASH, block_hashes
from radixserve.engine.messages import GenerateRequest

# As the scheduler does: a request's future output is counted up to this many tokens, scaled by
# the scheduler's adaptive new-token ratio.
CLIP_NEW_TOKENS = 4096


class QueueRoom:
    """Room in the running batch, filled by waiting requests in arrival order; the rest is queued."""

    def __init__(self, core):
        sched = core.scheduler
        self.ratio = sched.new_token_ratio
        self.rows = min(sched.max_running - len(sched.running), sched.req_to_token.free_rows)
        running_need = sum(r.remaining + math.ceil(min(max(r.remaining_new_tokens(), 0), CLIP_NEW_TOKENS) * self.ratio)
                           for r in sched.running)
        self.tokens = core.kv_pool.allocator.free_tokens + core.cache.evictable_size - running_need
        self.fitted = 0
        for req in sched.waiting:
            if self.rows <= 0:
                break
            self.take(req.seq_len, req.remaining_new_tokens())

    def take(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Reserve room for one request; False (nothing reserved) when the batch is full."""
        need = prompt_tokens + math.ceil(min(max_new_tokens, CLIP_NEW_TOKENS) * self.ratio)
        if self.rows <= 0 or need > self.tokens:
            return False
        self.rows -= 1
        self.tokens -= need
        self.fitted += 1
        return True

    def admits(self, req: GenerateRequest, waiting: int, limit: Optional[int]) -> bool:
        """Whether `req` may join the `waiting` requests under the queue limit."""
        if self.take(len(req.input_ids), req.sampling_params.max_new_tokens):
            return True
        return limit is None or waiting - self.fitted < limit


class KvHashEvents:
    """Records the cache's events while someone follows them; publishes them as block hashes."""

    def __init__(self, cache, block_size: int = KV_HASH_BLOCK_TOKENS):
        self.cache = cache
        self.block_size = block_size
        self.on = False  # recording starts when the first subscriber asks for a snapshot
        self.seq = 0
        self.raw: list[tuple[str, list[int]]] = []
        cache.event_listener = self.record

    def record(self, kind: str, tokens: list[int]) -> None:
        if self.on:
            self.raw.append((kind, tokens))

    def take(self) -> list[list]:
        """The events since the last call as [seq, kind, [hash, ...]]. Evictions are resolved
        against the tree as it is now: within one batch a later event can only restore what an
        earlier one removed, and the batch is applied whole."""
        events = []
        for kind, tokens in self.raw:
            self.seq += 1
            if kind == "insert":
                hashes = block_hashes(tokens, self.block_size)
            elif kind == "evict":
                held, _ = self.cache.peek(tokens)
                hashes = block_hashes(tokens, self.block_size)[held // self.block_size:]
            else:
                hashes = []
            events.append([self.seq, kind, hashes])
        self.raw = []
        return events

    def snapshot(self) -> dict[str, Any]:
        """Every whole block the tree holds, with the sequence number of the last event in it.
        Call `take()` first: events recorded but not yet numbered would be lost."""
        assert not self.raw
        self.on = True
        blocks: list[str] = []
        stack = [(self.cache.root, ROOT_HASH, [])]
        while stack:
            node, parent, carry = stack.pop()
            for child in node.children.values():
                run = carry + list(child.key)
                hashes = block_hashes(run, self.block_size, parent)
                blocks.extend(hashes)
                stack.append((child, hashes[-1] if hashes else parent, run[len(hashes) * self.block_size:]))
        return {"seq": self.seq, "block_size": self.block_size, "blocks": blocks}
