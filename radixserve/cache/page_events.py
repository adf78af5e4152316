"""The prefix cache's page events: one record of what the cache gained and lost, in one hash, read
by both things that follow it.

The tree and its stores tell one listener (`PageEventListener`, installed as `RadixTree.events`)
of every change, each once:

- `stored(medium, node)` / `removed(medium, node)`: the node's pages gained or lost their KV on a
  tier (medium "GPU": the device pool, a CPU-only server's too; "CPU": the host tier);
- `usable(node)` / `unusable(node)`: a match can now end at node (its path is reusable), or node's
  path may have stopped being reusable (it leaves the tree; its last snapshot went). Without
  snapshots every cached path is reusable; with them KV alone resumes nobody, so a path becomes
  usable when a snapshot is hung on it, not when its KV is stored (`PublishedCache.on_reusable_path`);
- `cleared()`: the cache was flushed.

`PageEvents` records them and feeds two readers:

- the vLLM-format publisher (`engine.kv_publisher`): `take_blocks()`, per tier, one block per page;
- `GET /kv_events` (`server.kv_events`, what the `kv_aware` router mirrors): `take_hashes()` and
  `snapshot()`, hashes of the reusable paths' whole blocks of `block_size` tokens, never token ids.

One hash names every page: `block_hash.page_hashes`, chained along the path and, in a cache
namespace (a `cache_salt`, a per-key cache), from the namespace's own parent
(`namespace.namespace_page_parent`), so two tenants' pages of the same tokens never share a hash.
A `/kv_events` block is a run of whole pages, hashed by the same chain with the block as its unit
(`block_hash.block_hashes`: where a page holds a block or more, the block's hash is its page's;
with smaller pages the engine and a router hash once per block, not once per page); blocks are
kept at KV_HASH_BLOCK_TOKENS tokens or more (rounded up to pages) because a short block's tokens
are easy to guess from its hash. The storage
tier keys its page files by the same hash (`disk_tier`).

Hashes are computed when the event happens (a later split would change which pages a node holds)
and memoised on the node (`TreeNode.block_hash`, its last page's hash), so a per-tier event costs
its own pages' hashing, not its path's. A salted namespace's blocks carry no token ids: its events
go to whoever subscribes, and a salt exists to keep its prompts from everyone else.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from radixserve.cache.block_hash import KV_HASH_BLOCK_TOKENS, block_hashes, page_hashes
from radixserve.cache.namespace import namespace_page_parent
from radixserve.cache.prefix_cache import PublishedCache, TreeNode

# The two readers. A reader's events are recorded only while it follows the cache.
BLOCKS = "blocks"  # the vLLM-format publisher
HASHES = "hashes"  # /kv_events


class PageEventListener(Protocol):
    """What the tree and its stores call when what the cache holds changes."""

    def stored(self, medium: str, node: TreeNode) -> None: ...

    def removed(self, medium: str, node: TreeNode) -> None: ...

    def usable(self, node: TreeNode) -> None: ...

    def unusable(self, node: TreeNode) -> None: ...

    def cleared(self) -> None: ...


def page_events(cache: PublishedCache, *, block_tokens: int = KV_HASH_BLOCK_TOKENS) -> "PageEvents":
    """The cache's recorder, installed on first use: the publisher and /kv_events share it."""
    events = cache.events
    if not isinstance(events, PageEvents):
        events = PageEvents(cache, block_tokens=block_tokens)
    return events


class PageEvents:
    """Records the cache's page events for the readers that follow it (`follow_blocks`, and
    /kv_events from its first `snapshot()`), each reading its own kinds with its own take."""

    def __init__(self, cache: PublishedCache, *, block_tokens: int = KV_HASH_BLOCK_TOKENS):
        self.cache = cache
        self.page_size = cache.page_size
        # A /kv_events block: whole pages, at least block_tokens tokens.
        self.block_pages = max(1, -(-block_tokens // self.page_size))
        self.block_size = self.block_pages * self.page_size
        self.unsalted_token_ids = True
        self.following: set[str] = set()
        self.blocks: list[tuple] = []
        self.hashes: list[tuple[str, list[str], list[int], Optional[str]]] = []
        self.seq = 0  # /kv_events' event numbers
        cache.events = self

    def follow_blocks(self, *, unsalted_token_ids: bool = True) -> None:
        """Record per-tier block events from now on (the publisher). unsalted_token_ids False empties
        the shared cache's blocks' token ids too."""
        self.unsalted_token_ids = unsalted_token_ids
        self.following.add(BLOCKS)

    # ------------------------------------------------------------------ the listener
    def stored(self, medium: str, node: TreeNode) -> None:
        if BLOCKS in self.following:
            parent = path_page_hash(node.parent, self.page_size)
            hashes = self._node_hashes(node, parent)
            reported = None if node.parent.namespace is not None else parent  # a namespace's first page
            tokens = list(node.key) if self.unsalted_token_ids and not salted(node) else []
            self.blocks.append(("BlockStored", hashes, reported, tokens, medium))

    def removed(self, medium: str, node: TreeNode) -> None:
        if BLOCKS in self.following:
            hashes = self._node_hashes(node, path_page_hash(node.parent, self.page_size))
            self.blocks.append(("BlockRemoved", hashes, medium))

    def usable(self, node: TreeNode) -> None:
        if HASHES in self.following:
            self.hashes.append(("insert", self._block_hashes(*path_of(node)), [], None))

    def unusable(self, node: TreeNode) -> None:
        # Which of the path's blocks go is resolved at take(): the tree may still hold them.
        if HASHES in self.following:
            tokens, namespace = path_of(node)
            self.hashes.append(("evict", self._block_hashes(tokens, namespace), tokens, namespace))

    def cleared(self) -> None:
        if BLOCKS in self.following:
            self.blocks.append(("AllBlocksCleared",))
        if HASHES in self.following:
            self.hashes.append(("flush", [], [], None))

    # ------------------------------------------------------------------ the readers
    def take_blocks(self) -> list[tuple]:
        """The per-tier block events since the last call, as the publisher encodes them:
        ("BlockStored", hashes, parent_hash, token_ids, medium), ("BlockRemoved", hashes, medium),
        ("AllBlocksCleared",)."""
        events, self.blocks = self.blocks, []
        return events

    def take_hashes(self) -> list[list]:
        """The /kv_events events since the last call as [seq, kind, [hash, ...]]. Evictions are
        resolved against the tree as it is now: within one batch a later event can only restore
        what an earlier one removed, and the batch is applied whole."""
        events = []
        for kind, hashes, tokens, namespace in self.hashes:
            self.seq += 1
            if kind == "evict":
                held = self.cache.reusable_len(tokens, namespace=namespace)
                hashes = hashes[held // self.block_size:]
            events.append([self.seq, kind, hashes])
        self.hashes = []
        return events

    def snapshot(self) -> dict[str, Any]:
        """Every whole block on the tree's reusable paths, with the sequence number of the last event
        in it; /kv_events is followed from now on. Call `take_hashes()` first: events recorded but
        not yet numbered would be lost."""
        assert not self.hashes
        self.following.add(HASHES)
        blocks: list[str] = []
        bs = self.block_size
        # (node, the hash of the last whole block above its children, the tokens after that block)
        stack: list[tuple[TreeNode, Optional[int], list[int]]] = [(self.cache.root, None, [])]
        while stack:
            node, parent, pending = stack.pop()
            for child in node.children.values():
                if child.namespace is not None:  # a namespace's root: its blocks chain from its hash
                    stack.append((child, child.block_hash, []))
                    continue
                if not self.cache.on_reusable_path(child):
                    continue
                tokens = pending + list(child.key)
                hashes = block_hashes(tokens, bs, parent)
                blocks.extend(hashes)
                rest = tokens[len(hashes) * bs:]
                stack.append((child, int(hashes[-1], 16) if hashes else parent, rest))
        return {"seq": self.seq, "block_size": self.block_size, "page_size": self.page_size, "blocks": blocks}

    # ------------------------------------------------------------------ hashing
    def _node_hashes(self, node: TreeNode, parent: Optional[int]) -> list[int]:
        """The hashes of node's pages, chained from parent (its parent's last page); memoises the last."""
        hashes = page_hashes(node.key, self.page_size, parent)
        node.block_hash = hashes[-1]
        return hashes

    def _block_hashes(self, tokens: list[int], namespace: Optional[str]) -> list[str]:
        """The /kv_events blocks of a path's tokens in its namespace."""
        return block_hashes(tokens, self.block_size, namespace_page_parent(namespace))

def path_of(node: TreeNode) -> tuple[list[int], Optional[str]]:
    """The tokens from node's namespace root to node's end, and that namespace."""
    keys = []
    while node.parent is not None and node.namespace is None:
        keys.append(node.key)
        node = node.parent
    return [t for key in reversed(keys) for t in key], node.namespace


def salted(node: TreeNode) -> bool:
    """Whether node is in a cache namespace (under a namespace root), not the shared cache."""
    while node.parent is not None and node.parent.parent is not None:
        node = node.parent
    return node.namespace is not None


def path_page_hash(node: Optional[TreeNode], page_size: int) -> Optional[int]:
    """The hash of the last page on the path to node (None for the root; a namespace root's is its
    parent hash), memoising it on the way: the events' hash, which the storage tier keys pages by too."""
    unhashed = []
    while node is not None and node.parent is not None and node.block_hash is None:
        unhashed.append(node)
        node = node.parent
    h = None if node is None or node.parent is None else node.block_hash
    for n in reversed(unhashed):
        h = page_hashes(n.key, page_size, h)[-1]
        n.block_hash = h
    return h
