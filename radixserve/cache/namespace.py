"""Cache namespaces: requests with different cache salts never share a cached prefix.

A request's namespace is a digest of its `cache_salt` (vLLM's field) and, with
`--cache-salt-per-api-key`, of the API key it was sent with; None is the shared namespace of
requests with neither. The prefix cache keeps each namespace under its own child of the tree's
root (`RadixCache`), so lookups, inserts, eviction, the host tier and LPM order work in it as in
the shared one, and a match never crosses into another namespace.

Published page hashes chain from the namespace (`namespace_page_parent`), so a
router or gateway that routes by them never sees another tenant's prefix as shared. A router
derives the same namespace from the request body and headers it forwards (`radixserve.router.keys`).

No torch here: the API process and the router import it.
"""

from __future__ import annotations

import hashlib
from typing import Optional

# The longest cache_salt accepted (characters). vLLM suggests 43 characters of base64 (256 bits).
MAX_CACHE_SALT_CHARS = 1024
_DOMAIN = b"radixserve cache namespace\0"


def cache_namespace(salt: Optional[str], api_key: Optional[str] = None) -> Optional[str]:
    """The namespace of a request with this salt, sent with this API key where keys isolate (None:
    they do not, or none was sent): None without either, else 32 hex digits (128 bits, so no
    salt can be found that lands in another's namespace)."""
    if salt is None and api_key is None:
        return None
    h = hashlib.blake2b(_DOMAIN, digest_size=16)
    for label, value in ((b"salt", salt), (b"key", api_key)):
        if value is not None:
            data = value.encode("utf-8", "surrogatepass")
            h.update(label + len(data).to_bytes(8, "big") + data)  # length-prefixed: no two inputs meet
    return h.hexdigest()


def namespace_page_parent(namespace: Optional[str]) -> Optional[int]:
    """What the `block_hash.page_hashes` chain of a namespace's pages starts from (None: the shared
    namespace's root): every published hash of a salted prompt differs from another namespace's."""
    if namespace is None:
        return None
    digest = hashlib.blake2b(_DOMAIN + b"pages" + bytes.fromhex(namespace), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def is_cache_namespace(value: object) -> bool:
    """None or what `cache_namespace` makes (32 lowercase hex digits)."""
    return value is None or (isinstance(value, str) and len(value) == 32
                             and all(c in "0123456789abcdef" for c in value))


def check_cache_salt(salt: object) -> None:
    """ValueError naming cache_salt unless it is None or a string of 1 to MAX_CACHE_SALT_CHARS characters."""
    if salt is None:
        return
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters")
