"""How much host memory a host tier may take: checked before it is built, against what the OS says
is available (MemAvailable), so a `--hicache-size` beyond the machine is one line at start-up
instead of minutes building a free list and then a traceback (111 s and 15.6 GB once)."""

from __future__ import annotations

from typing import Optional

MEMINFO = "/proc/meminfo"


def available_host_bytes() -> Optional[int]:
    """MemAvailable in bytes (memory the OS can hand out without swapping), or None where unknown."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(needed_bytes: int, what: str) -> None:
    """ValueError naming `what` when `needed_bytes` is more than the host has available."""
    available = available_host_bytes()
    if available is not None and needed_bytes > available:
        raise ValueError(f"{what} needs {needed_bytes / 1e9:.1f} GB of host memory; {available / 1e9:.1f} GB is "
                         "available: lower it")
