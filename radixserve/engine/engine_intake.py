"""Engine-process helper for what leaves the cache: its events as chained block hashes (the
waiting-queue limit is the scheduler's own admission arithmetic, `EngineCore.queue_room`).

`KvHashEvents` turns the cache's insert/evict/flush events into the hashes of whole token blocks
(`radixserve.cache.block_hash`): an insert publishes the blocks of the inserted path, an eviction
the blocks of the evicted path no match can use any more, so a mirror that adds and discards those
hashes holds exactly the tree's whole blocks on paths a match can use (`PrefixCache.
on_reusable_path`: every path of a tree of KV alone; a hybrid model's paths to its recurrent-state
snapshots). Token ids never leave the engine.
"""

from __future__ import annotations

from typing import Any, Optional

from radixserve.cache.block_hash import KV_HASH_BLOCK_TOKENS, block_hashes
from radixserve.cache.namespace import namespace_parent
from radixserve.cache.prefix_cache import PrefixCache


class KvHashEvents:
    """Records the cache's events while someone follows them; publishes them as block hashes."""

    def __init__(self, cache: PrefixCache, block_size: int = KV_HASH_BLOCK_TOKENS):
        self.cache = cache
        self.block_size = block_size
        self.on = False  # recording starts when the first subscriber asks for a snapshot
        self.seq = 0
        self.raw: list[tuple[str, list[int], Optional[str]]] = []
        cache.event_listener = self.record

    def record(self, kind: str, tokens: list[int], namespace: Optional[str]) -> None:
        if self.on:
            self.raw.append((kind, tokens, namespace))

    def take(self) -> list[list]:
        """The events since the last call as [seq, kind, [hash, ...]]. Evictions are resolved
        against the tree as it is now: within one batch a later event can only restore what an
        earlier one removed, and the batch is applied whole."""
        events = []
        for kind, tokens, namespace in self.raw:
            self.seq += 1
            # A cache namespace's blocks chain from its own hash: never equal to another's.
            parent = namespace_parent(namespace)
            if kind == "insert":
                hashes = block_hashes(tokens, self.block_size, parent)
            elif kind == "evict":
                held = self.cache.reusable_len(tokens, namespace=namespace)
                hashes = block_hashes(tokens, self.block_size, parent)[held // self.block_size:]
            else:
                hashes = []
            events.append([self.seq, kind, hashes])
        self.raw = []
        return events

    def snapshot(self) -> dict[str, Any]:
        """Every whole block on the tree's reusable paths, with the sequence number of the last event
        in it. Call `take()` first: events recorded but not yet numbered would be lost."""
        assert not self.raw
        self.on = True
        blocks: list[str] = []
        stack = [(self.cache.root, namespace_parent(None), [])]
        while stack:
            node, parent, carry = stack.pop()
            for child in node.children.values():
                if child.namespace is not None:  # a namespace's root: its blocks chain from its hash
                    stack.append((child, namespace_parent(child.namespace), []))
                    continue
                if not self.cache.on_reusable_path(child):
                    continue
                run = carry + list(child.key)
                hashes = block_hashes(run, self.block_size, parent)
                blocks.extend(hashes)
                stack.append((child, hashes[-1] if hashes else parent, run[len(hashes) * self.block_size:]))
        return {"seq": self.seq, "block_size": self.block_size, "blocks": blocks}
