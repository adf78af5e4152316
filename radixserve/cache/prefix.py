"""Prefix arithmetic shared by the radix cache and the router's trees (no torch: the router imports it)."""

from __future__ import annotations

from typing import Sequence


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of two sequences (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] holds, a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
