"""The API keys a server or router accepts: `--api-key` (repeatable) and `--api-key-file`.

Key file format, one key a line:

    # comments and blank lines are skipped
    sk-3f9a...            (a key alone: named "key 2" in logs, by its line's place among the keys)
    sk-81c0...  alice     (a key, whitespace, then a name for logs)

The admin key (`--admin-api-key-file`) is a file of its own holding one key.

A key is a bearer token: no whitespace in it (RFC 6750's token has none), so the first word of a
line is the key and the second, if any, its tenant's name (letters, digits, `.`, `_`, `-`, `@`; at
most 64). More than two words, a key listed twice, or a bad name is refused with the line number,
never the key. A file that others than its owner can read is used with a warning.

The name is what the start-up log line shows instead of a key; it does not group keys. With more than one key each
key's requests get their own prefix cache by default (the server's `--shared-cache-across-keys`
turns that off): the namespace is made from the key as sent (`radixserve.cache.namespace`), so it
is as hard to guess as the key, and a router computes the same from the bearer token it forwards.

A request's token is looked up by its SHA-256 digest: the lookup's time depends on the digest,
never on how much of a key was guessed right, whatever the number of keys.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

logger = logging.getLogger("radixserve")

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


@dataclass(frozen=True)
class ApiKey:
    key: str = field(repr=False)
    label: str  # the tenant's name, or "key N": what the log says instead of the key


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class ApiKeyRing:
    """The accepted keys, each with its label; empty: no key is asked for."""

    def __init__(self, keys: Iterable[ApiKey] = ()):
        self.keys: list[ApiKey] = list(keys)
        self._by_digest = {_digest(k.key.encode()): k for k in self.keys}
        if len(self._by_digest) != len(self.keys):
            raise ValueError("an API key is given twice")

    def __len__(self) -> int:
        return len(self.keys)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __repr__(self) -> str:  # never the keys
        return f"ApiKeyRing({', '.join(self.labels)})"

    def match(self, token: Optional[bytes]) -> Optional[ApiKey]:
        """The key `token` is (None: none of them)."""
        if token is None:
            return None
        return self._by_digest.get(_digest(token))

    @property
    def labels(self) -> list[str]:
        return [k.label for k in self.keys]

    @property
    def first_key(self) -> Optional[str]:
        """The key a router uses for its own calls to the workers."""
        return self.keys[0].key if self.keys else None

    def isolates_cache(self, per_key_flag: bool, shared_flag: bool) -> bool:
        """Whether each key's requests get their own prefix cache: asked for
        (--cache-salt-per-api-key), or by default where there is more than one key and
        --shared-cache-across-keys does not say otherwise."""
        return per_key_flag or (len(self.keys) > 1 and not shared_flag)

    def describe(self, isolated: bool) -> str:
        """One log line's worth: how many keys, their labels, whether their caches are apart."""
        if not self.keys:
            return "no API key: every endpoint but the admin ones is open"
        cache = ("each key has its own prefix cache" if isolated else
                 "one prefix cache shared by every key" if len(self.keys) > 1 else "one prefix cache")
        return f"{len(self.keys)} API key(s) ({', '.join(self.labels)}); {cache}"


def check_key(key: str, where: str) -> None:
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{where}: an API key must be non-empty, without whitespace")


def parse_key_file(text: str, path: str, first_number: int = 1) -> list[ApiKey]:
    """The keys of a key file's text; ValueError naming the line (never the key) at fault.
    first_number: the label number of its first unnamed key."""
    keys: list[ApiKey] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 2:
            raise ValueError(f"{path}, line {number}: expected KEY or KEY NAME, got {len(words)} words")
        name = words[1] if len(words) == 2 else None
        if name is not None and not TENANT_NAME.fullmatch(name):
            raise ValueError(f"{path}, line {number}: a tenant name is 1-64 letters, digits, '.', '_', '-' or '@', "
                             "starting with a letter or digit")
        keys.append(ApiKey(words[0], name or f"key {first_number + len(keys)}"))
    return keys


def load_admin_key(key: Optional[str], key_file: Optional[str], flag: str = "--admin-api-key") -> Optional[str]:
    """The admin key given itself or as the one key of a file (`flag`-file: its first line that is not
    blank or a # comment); ValueError saying what is wrong, never showing the key."""
    if key is not None and key_file is not None:
        raise ValueError(f"give {flag} or {flag}-file, not both")
    if key_file is None:
        return key
    try:
        with open(key_file, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}-file: cannot read {key_file}: {getattr(e, 'strerror', None) or e}") from None
    if len(lines) != 1:
        raise ValueError(f"{flag}-file: {key_file} must hold one key, found {len(lines)} lines")
    check_key(lines[0], f"{flag}-file {key_file}")
    return lines[0]


def load_key_ring(keys: Sequence[str] = (), key_file: Optional[str] = None, *, warn: bool = True) -> ApiKeyRing:
    """The keys given on the command line (labelled "key 1", ...) and in the key file, in that order;
    ValueError saying what is wrong, never showing a key. warn: log a key file others can read."""
    ring = [ApiKey(k, f"key {i}") for i, k in enumerate(keys, 1)]
    for k in ring:
        check_key(k.key, "--api-key")
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file: cannot read {key_file}: {getattr(e, 'strerror', None) or e}") from None
        from_file = parse_key_file(text, key_file, first_number=len(ring) + 1)
        if not from_file:
            raise ValueError(f"--api-key-file: {key_file} holds no key")
        if warn and mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("--api-key-file %s can be read by others than its owner (mode %o): chmod 600 it",
                           key_file, stat.S_IMODE(mode))
        ring += from_file
    try:
        return ApiKeyRing(ring)
    except ValueError as e:
        raise ValueError(f"--api-key / --api-key-file: {e}") from None
