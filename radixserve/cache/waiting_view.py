"""The prefix cache as the waiting queue sees it (`PrefixCache.waiting`).

A waiting request is parked at the tree node its cached prefix ends in, under a park key: which
change under that node could lengthen its match (`scheduler/waiting_queue.py` looks it up again
only when the tree reports such a change, `drain_touched`). While it waits, the path to its node
counts as wanted (`add_waiter`): queue-aware eviction takes such paths last, and admission does
not count them as spare (`CacheMemory.reclaimable`). A request whose prefix is partly on a lower
tier has the copy back to the device started as it arrives (`admit_ahead`); the copies are taken
in at the start of each step (`poll`), before the parked lookups are redone.

These sit apart from `PrefixCache` because only the waiting queue and the scheduler's intake ask
for them; the handles they pass are the tree's nodes, as everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Protocol, Sequence

from radixserve.cache.tree import TreeNode

if TYPE_CHECKING:
    from collections import deque

    from radixserve.cache.admission import Waiter


class WaitingView(Protocol):
    root: TreeNode  # never matched, locked or evicted; every parked node hangs below it

    def peek_park(self, tokens: Sequence[int], *, namespace: Optional[str] = None) -> tuple[int, TreeNode, object]:
        """The usable cached length of tokens on any tier (page-aligned), the node that match ends
        in, and the park key: which change under that node could lengthen it. Never changes the
        tree."""

    def add_waiter(self, node: TreeNode) -> None:
        """A waiting request will reuse the path to node: evict it only when nothing else is left."""

    def remove_waiter(self, node: TreeNode) -> None:
        """Undo one `add_waiter` of node (the request was admitted, left, or parks elsewhere)."""

    def admit_ahead(self, arrivals: "deque[Waiter]", room: int) -> int:
        """Start the copies newly arrived requests will wait for, within `room` device tokens;
        drops from `arrivals` those looked at. Returns the device tokens those copies take."""

    def poll(self) -> bool:
        """The start of a step: take in finished copies from lower tiers (and finish whatever else
        the cache left in flight between steps); True when a load finished."""

    def drain_touched(self) -> set[tuple[TreeNode, object]]:
        """(node, park key) pairs whose lookups may have changed since the last call."""

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node of the tree, the root included (the waiter counts are checked over them)."""
