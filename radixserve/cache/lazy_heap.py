"""Lazy eviction heaps: entries (priority, node) are pushed when a node's priority may have changed
and checked when popped, rather than updated in place (a node's priority moves with every access)."""

from __future__ import annotations

import heapq
from typing import Callable, Iterator, TypeVar

Node = TypeVar("Node")
Entry = tuple[tuple, Node]


def current_entries(heap: list[Entry], priority: Callable[[Node], tuple], *, gone: Callable[[Node], bool],
                    held: Callable[[Node], bool], kept: list[Entry]) -> Iterator[Entry]:
    """Pop heap's entries least first and yield each whose priority is current: an entry of a node
    that is gone is dropped, one of a node held is set aside in `kept` (the caller pushes `kept`
    back once its search is over), a stale one goes back at the node's current priority."""
    while heap:
        prio, node = heapq.heappop(heap)
        if gone(node):
            continue
        if held(node):
            kept.append((prio, node))
            continue
        current = priority(node)
        if prio != current:
            heapq.heappush(heap, (current, node))
            continue
        yield current, node
