"""The radix cache's pages as KV-event blocks: what a cluster's KV-aware router follows.

One block is one page (`--page-size` tokens). Its hash chains the hash of the page before it on
the path (`block_hash.page_hashes`), so one hash names the whole prefix up to the end of its page,
and a node of k pages is k blocks. Events, in cache order:

- ("BlockStored", hashes, parent_hash, token_ids, medium): a node's pages got their KV on a tier
  (medium "GPU": the device pool, a CPU-only server's too; "CPU": the host tier). parent_hash is
  the block before the first (None at the root); token_ids are the pages' tokens, which consumers
  re-hash with their own function, so what matters is that tokens and parent links are right.
- ("BlockRemoved", hashes, medium): those pages lost their KV on that tier.
- ("AllBlocksCleared",): the cache was flushed.

A cache namespace's pages (requests with a `cache_salt`, or of a per-key cache) chain from a hash
of the namespace (`namespace.namespace_page_parent`), so they never equal another namespace's pages
of the same tokens; the first page of a namespace reports no parent, as the first page of any path
does. They are stored with no token ids (vLLM's BlockStored allows an empty list): the events go
to whoever subscribes, or replays from the first batch, and a salt exists to keep its prompts from
everyone else; a gateway routes salted requests by these hashes. `unsalted_token_ids` False
empties the shared cache's blocks' token ids too.

Hashes are computed when the event happens (a later split of the node would change which pages it
holds) and memoised on the node (`TreeNode.block_hash`, its last page's hash), so an event costs
its own pages' hashing, not its path's.
"""

from __future__ import annotations

from typing import Optional

from radixserve.cache.block_hash import page_hashes
from radixserve.cache.prefix_cache import PrefixCache, TreeNode

StoredEvent = tuple[str, list[int], Optional[int], list[int], str]


class BlockEventRecorder:
    """Collects the cache's block events until `take()`; installs itself as the cache's block listener."""

    def __init__(self, cache: PrefixCache, *, unsalted_token_ids: bool = True):
        self.cache = cache
        self.page_size = cache.page_size
        self.unsalted_token_ids = unsalted_token_ids
        self.events: list[tuple] = []
        cache.block_listener = self.record

    def record(self, kind: str, medium: str, node: TreeNode) -> None:
        if kind == "cleared":
            self.events.append(("AllBlocksCleared",))
            return
        parent = self.hash_of(node.parent)
        hashes = page_hashes(node.key, self.page_size, parent)
        node.block_hash = hashes[-1]
        if kind == "stored":
            reported = None if node.parent.namespace is not None else parent  # a namespace's first page
            tokens = list(node.key) if self.unsalted_token_ids and not self.salted(node) else []
            self.events.append(("BlockStored", hashes, reported, tokens, medium))
        else:
            self.events.append(("BlockRemoved", hashes, medium))

    @staticmethod
    def salted(node: TreeNode) -> bool:
        """Whether node is in a cache namespace (under a namespace root), not the shared cache."""
        while node.parent is not None and node.parent.parent is not None:
            node = node.parent
        return node.namespace is not None

    def hash_of(self, node: Optional[TreeNode]) -> Optional[int]:
        """The hash of the last page on the path to node (None for the root), memoising it on the way."""
        return path_page_hash(node, self.page_size)

    def take(self) -> list[tuple]:
        events, self.events = self.events, []
        return events


def path_page_hash(node: Optional[TreeNode], page_size: int) -> Optional[int]:
    """The hash of the last page on the path to node (None for the root; a namespace root's is its
    parent hash), memoising it on the way: the KV events' hash, which the storage tier keys pages by too."""
    unhashed = []
    while node is not None and node.parent is not None and node.block_hash is None:
        unhashed.append(node)
        node = node.parent
    h = None if node is None or node.parent is None else node.block_hash
    for n in reversed(unhashed):
        h = page_hashes(n.key, page_size, h)[-1]
        n.block_hash = h
    return h
