"""How many connections an HTTP process may hold: a cap below its open-file limit, so that slow
or idle clients are refused with a 503 instead of using up the file descriptors every new client,
log file and engine socket needs (1,010 half-sent requests under `ulimit -n 1024` made every new
client fail)."""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger("radixserve")

# Descriptors kept for everything but client connections: engine sockets, log files, the
# tokenizer's and the router's own outgoing connections.
RESERVED_FILES = 256
# The soft limit is raised to the hard one, but no further than this (a cap of a million
# connections would mean no cap).
MAX_SOFT_LIMIT = 65536


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit towards the hard one (no privilege needed); returns the soft
    limit now in force."""
    try:
        import resource
    except ImportError:  # not on this platform
        return MAX_SOFT_LIMIT
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, MAX_SOFT_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return MAX_SOFT_LIMIT if soft == resource.RLIM_INFINITY else soft


def connection_cap(requested: Optional[int]) -> int:
    """--max-connections, or what the open-file limit leaves after RESERVED_FILES; a requested
    cap above that is lowered to it (and logged), since past it accept() itself would fail."""
    soft = raise_open_file_limit()
    room = max(1, soft - RESERVED_FILES)
    if requested is None:
        return room
    if requested > room:
        logger.warning("--max-connections %d is more than the open-file limit (%d) leaves; using %d "
                       "(raise the limit: ulimit -n, or the container's nofile)", requested, soft, room)
        return room
    return requested
