"""The one hash of cached tokens: chained hashes of whole pages, how a cache's contents are named
without tokens (KV events, `/kv_events`, the storage tier's page files).

Page i of a sequence hashes (hash of page i-1, the page's token ids), so one hash stands for the
whole prefix up to the end of its page: two sequences share page i's hash exactly when they share
their first (i + 1) * page_size tokens (and their namespace: a salted namespace's chain starts
from its own parent, `namespace.namespace_page_parent`). A router that mirrors a worker's cache
as a set of these hashes finds a prompt's cached prefix by hashing the prompt the same way and
counting how many leading hashes the set holds.

The hashes are unkeyed (anyone can compute them), so they hide tokens only as far as the tokens
between two published hashes cannot be guessed: `/kv_events` publishes one hash per block of at
least KV_HASH_BLOCK_TOKENS tokens (`block_hashes`: the same chain with the block as its unit), and
it is an admin endpoint.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

# The fewest tokens per `/kv_events` block (rounded up to whole pages). Larger blocks are harder to
# guess and cost a router at most block_size - 1 tokens of match precision per prompt.
KV_HASH_BLOCK_TOKENS = 16


def page_hashes(tokens: Sequence[int], page_size: int, parent: Optional[int]) -> list[int]:
    """64-bit chained hashes of the whole pages of `tokens`, each over the hash before it (`parent`,
    None at the shared root, a namespace's parent in a salted one) and the page's token ids. They
    are the block hashes of the vLLM-format KV events (whose consumers may re-hash the token ids
    with their own function: these have to name each page of a path uniquely) and of `/kv_events`."""
    n = len(tokens) // page_size
    data = array("q", tokens[:n * page_size]).tobytes()
    step = 8 * page_size
    prev = _ROOT_PARENT if parent is None else parent.to_bytes(8, "big")
    out = []
    for i in range(n):
        prev = hashlib.blake2b(prev + data[i * step:(i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


def hex_hash(h: int) -> str:
    """A page hash as `/kv_events` writes it: 16 hex digits."""
    return f"{h:016x}"


def block_hashes(tokens: Sequence[int], block_size: int = KV_HASH_BLOCK_TOKENS,
                 parent: Optional[int] = None) -> list[str]:
    """The `/kv_events` hashes of the whole blocks of `tokens`, in hex: the same chained hash with
    the block as its unit (`page_hashes(tokens, block_size, parent)`). A block is whole pages, so
    where a page holds the block's tokens or more the two coincide; with smaller pages a router
    hashes a prompt once per block, not once per page (a 10,000-token prompt at page size 1:
    625 hashes, not 10,000)."""
    whole = len(tokens) - len(tokens) % block_size
    return [hex_hash(h) for h in page_hashes(tokens[:whole], block_size, parent)]


# What the first page of a path chains from: unlike any 8-byte hash a page can get in practice.
_ROOT_PARENT = b"radixkv\0"
