"""Prefix trees the router matches prompts against, one per worker.

`PrefixTree` is a radix tree over a sequence of symbols: characters of a `str` or token ids of a
list. Keys of both kinds may live in one tree (a character never equals an int, so they never
share a node). It serves two uses:

- the *approximate* tree of `cache_aware`: what was routed to a worker, bounded by `max_size`
  symbols with least-recently-used leaves trimmed first;
- the in-flight prompts `kv_aware` adds to what a worker's cache holds.

`BlockHashMirror` is `kv_aware`'s mirror of what a worker's radix cache really holds: the chained
block hashes of the worker's `/kv_events`, never token ids.
"""

from __future__ import annotations

import itertools
from typing import Optional, Union

from radixserve.cache.block_hash import KV_HASH_BLOCK_TOKENS, block_hashes
from radixserve.cache.namespace import namespace_page_parent
from radixserve.cache.prefix import common_prefix_len

Key = Union[str, list[int], tuple[int, ...]]


class _Node:
    __slots__ = ("key", "children", "parent", "last_access", "is_end")

    def __init__(self, key: Key, parent: Optional["_Node"], tick: int):
        self.key = key
        self.children: dict = {}
        self.parent = parent
        self.last_access = tick
        # True where an inserted sequence ends here (a boundary the worker's tree also has).
        self.is_end = False


class PrefixTree:
    def __init__(self, max_size: Optional[int] = None):
        self.max_size = max_size
        self.root = _Node("", None, 0)
        self.size = 0  # symbols held
        self._tick = itertools.count(1)

    # ------------------------------------------------------------------ queries
    def match_len(self, key: Key, touch: bool = False) -> int:
        """Length of the longest prefix of `key` held in the tree."""
        node, pos = self.root, 0
        tick = next(self._tick) if touch else 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, key[pos:pos + len(child.key)])
            if touch:
                child.last_access = tick
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def __len__(self) -> int:
        return self.size

    # ------------------------------------------------------------------ updates
    def insert(self, key: Key) -> int:
        """Add `key`; returns how many of its symbols were new. Trims to `max_size` afterwards."""
        if not len(key):
            return 0
        tick = next(self._tick)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:], node, tick)
                leaf.is_end = True
                node.children[key[pos]] = leaf
                self.size += len(leaf.key)
                added = len(key) - pos
                self._trim(protect=leaf)
                return added
            n = common_prefix_len(child.key, key[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node, pos = child, pos + n
        node.is_end = True
        return 0

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child` after n symbols; returns the new upper node."""
        parent = child.parent
        upper = _Node(child.key[:n], parent, child.last_access)
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def remove_path(self, key: Key) -> int:
        """Undo an eviction of the leaf that ends at `key`: drop the tail of that path back to the
        nearest branch or inserted end above it. Returns symbols removed."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None or common_prefix_len(child.key, key[pos:pos + len(child.key)]) < len(child.key):
                return 0  # not held (already gone)
            node, pos = child, pos + len(child.key)
        if node is self.root or node.children:  # the worker only evicts leaves; nothing to undo
            return 0
        removed = 0
        while node is not self.root and not node.children:
            parent = node.parent
            del parent.children[node.key[0]]
            self.size -= len(node.key)
            removed += len(node.key)
            node = parent
            if node.is_end:
                break
        return removed

    def clear(self) -> None:
        self.root = _Node("", None, 0)
        self.size = 0

    def load_edges(self, edges: list) -> None:
        """Replace the tree by a snapshot of [parent index, run] edges (index 0 is the root)."""
        self.clear()
        nodes = [self.root]
        tick = next(self._tick)
        for parent_index, run in edges:
            parent = nodes[parent_index]
            node = _Node(list(run), parent, tick)
            if run:
                parent.children[run[0]] = node
                self.size += len(run)
            nodes.append(node)
        for node in nodes[1:]:
            if not node.children:
                node.is_end = True

    # ------------------------------------------------------------------ LRU trimming
    def _trim(self, protect: Optional[_Node] = None) -> None:
        if self.max_size is None or self.size <= self.max_size:
            return
        # Trim to 90% so a full tree is not trimmed again on every insert.
        target = int(self.max_size * 0.9)
        leaves = sorted((n for n in self._iter_nodes() if not n.children and n is not protect),
                        key=lambda n: n.last_access)
        for leaf in leaves:
            if self.size <= target:
                break
            node = leaf
            while node is not self.root and not node.children and node is not protect:
                parent = node.parent
                del parent.children[node.key[0]]
                self.size -= len(node.key)
                node = parent
                if self.size <= target or node.last_access > leaf.last_access:
                    break

    def _iter_nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(node.children.values())


class BlockHashMirror:
    """The `kv_aware` mirror of a worker's radix cache: the set of chained block hashes the worker
    publishes (`radixserve.cache.block_hash`), kept in step by its insert/evict/flush events.

    A prompt is matched by hashing its whole blocks the same way and counting how many leading
    hashes the set holds; a chained hash stands for its whole prefix, so that count is the cached
    prefix in blocks. A key whose first symbol is a cache namespace (`router.keys`) is hashed from
    that namespace, as the worker hashes its blocks. The hashes of the last prompt asked about are
    kept, so routing one request over many workers hashes it once."""

    def __init__(self, block_size: int = KV_HASH_BLOCK_TOKENS):
        self.block_size = block_size
        self.blocks: set[str] = set()
        self._last_key: Optional[Key] = None
        self._last_hashes: list[str] = []

    def __len__(self) -> int:
        """Tokens held (whole blocks)."""
        return len(self.blocks) * self.block_size

    def hashes_of(self, key: Key) -> list[str]:
        if key is not self._last_key:
            self._last_key = key
            self._last_hashes = _key_hashes(key, self.block_size) if not isinstance(key, str) else []
        return self._last_hashes

    def match_len(self, key: Key, touch: bool = False) -> int:
        """Tokens of `key` in whole blocks the worker holds."""
        matched = 0
        for h in self.hashes_of(key):
            if h not in self.blocks:
                break
            matched += 1
        return matched * self.block_size

    def add(self, hashes: list[str]) -> None:
        self.blocks.update(hashes)

    def discard(self, hashes: list[str]) -> None:
        self.blocks.difference_update(hashes)

    def clear(self) -> None:
        self.blocks.clear()

    def load(self, block_size: int, hashes: list[str]) -> None:
        """Replace the mirror by a worker's snapshot."""
        self.block_size = block_size
        self.blocks = set(hashes)
        self._last_key, self._last_hashes = None, []

    def insert_tokens(self, tokens: Key) -> None:
        """Hold `tokens` as the worker would after caching them (for tests and warm starts)."""
        self.add(_key_hashes(tokens, self.block_size))


def _key_hashes(key: Key, block_size: int) -> list[str]:
    """The block hashes of a token key, from its namespace when it starts with one."""
    if len(key) and isinstance(key[0], str):
        return block_hashes(key[1:], block_size, namespace_page_parent(key[0]))
    return block_hashes(key, block_size)
