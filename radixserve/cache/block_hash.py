"""Chained hashes of fixed-size token blocks: how a cache's contents are published without tokens.

Block i of a sequence hashes (hash of block i-1, the block's tokens), so one hash stands for the
whole prefix up to the end of its block: two sequences share block i's hash exactly when they
share their first (i + 1) * block_size tokens. Only whole blocks are hashed. A router that mirrors
a worker's cache as a set of these hashes finds a prompt's cached prefix by hashing the prompt
the same way and counting how many leading hashes the set holds.

The hashes are unkeyed (anyone can compute them), so they hide tokens only as far as a block of
`block_size` tokens cannot be guessed; the stream that carries them is an admin endpoint.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

# Tokens per hashed block. Larger blocks are harder to guess and cost a router at most
# block_size - 1 tokens of match precision per prompt.
KV_HASH_BLOCK_TOKENS = 16
ROOT_HASH = "0" * 16


def block_hashes(tokens: Sequence[int], block_size: int = KV_HASH_BLOCK_TOKENS,
                 parent: str = ROOT_HASH) -> list[str]:
    """Hex hashes of the whole blocks of `tokens`, chained from `parent` (the hash before them)."""
    n = len(tokens) // block_size
    if n == 0:
        return []
    data = array("q", tokens[:n * block_size]).tobytes()
    step = 8 * block_size
    out = []
    for i in range(n):
        parent = hashlib.blake2b(bytes.fromhex(parent) + data[i * step:(i + 1) * step], digest_size=8).hexdigest()
        out.append(parent)
    return out


def page_hashes(tokens: Sequence[int], page_size: int, parent: Optional[int]) -> list[int]:
    """64-bit chained hashes of the whole pages of `tokens`, each over the hash before it (`parent`,
    None at the root) and the page's token ids: the block hashes of the KV events a cluster's
    router follows (`radixserve.cache.block_events`). Consumers re-hash the token ids the events
    carry with their own function; these only have to name each page of a path uniquely."""
    n = len(tokens) // page_size
    data = array("q", tokens[:n * page_size]).tobytes()
    step = 8 * page_size
    prev = _ROOT_PARENT if parent is None else parent.to_bytes(8, "big")
    out = []
    for i in range(n):
        prev = hashlib.blake2b(prev + data[i * step:(i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


# What the first page of a path chains from: unlike any 8-byte hash a page can get in practice.
_ROOT_PARENT = b"radixkv\0"
