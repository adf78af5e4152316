"""The copies rank 0 of a tensor-parallel engine makes for its prefix cache, recorded in issue order
for the other ranks to make on their own shards: host-tier KV loads and write-backs (on the copy
stream, numbered) and a hybrid model's recurrent-state snapshot copies (rows to snapshot slots and
back, device snapshots to the host tier and back). One log for every kind, so the ranks replay
them in the order rank 0 issued them, whatever the kind; each store that copies writes into the
same log (`CopyLog`), and `replay` hands each order back to the store of its kind."""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence


class CopyKind(enum.Enum):
    KV_LOAD = "kv_load"  # host KV slots -> device KV slots
    KV_WRITE_BACK = "kv_write_back"  # device KV slots -> host KV slots
    STATE_SAVE = "state_save"  # request state rows -> device snapshot slots
    STATE_RESTORE = "state_restore"  # device snapshot slots -> request state rows
    STATE_WRITE_BACK = "state_write_back"  # device snapshot slots -> host snapshot slots
    STATE_LOAD = "state_load"  # host snapshot slots -> device snapshot slots

    @property
    def of_kv(self) -> bool:
        return self in (CopyKind.KV_LOAD, CopyKind.KV_WRITE_BACK)


@dataclass
class CopyOrder:
    """One copy (or batch of copies) as rank 0 issued it: src[i] -> dst[i] in the slots or rows
    `kind` names; `seq`: a KV copy's sequence number on rank 0's copy stream (the ranks check they
    number it alike), 0 for the others."""
    kind: CopyKind
    src: array
    dst: array
    seq: int = 0


def slot_array(slots: Sequence[int]) -> array:
    return array("q", slots)


class CopyLog:
    """Rank 0's copies since the last message to the other ranks, in issue order."""

    def __init__(self) -> None:
        self.orders: list[CopyOrder] = []

    def record(self, kind: CopyKind, src: array, dst: array, seq: int = 0) -> None:
        self.orders.append(CopyOrder(kind, src, dst, seq))

    def take(self) -> list[CopyOrder]:
        taken, self.orders = self.orders, []
        return taken


class Replays(Protocol):
    """A store whose copies rank 0 records: it makes one of them on this rank's shard."""

    def replay(self, order: CopyOrder) -> None: ...


def replay(orders: Sequence[CopyOrder], kv: Optional[Replays], states: Optional[Replays]) -> None:
    """Make rank 0's copies on this rank's shards, in rank 0's order: the KV ones on this rank's
    copy engine (host_pool.CopyEngine), the state ones on its snapshot pool (and its host tier's;
    state_snapshots.StateSnapshots)."""
    for order in orders:
        store = kv if order.kind.of_kv else states
        if store is None:
            raise RuntimeError(f"rank 0 sent a {order.kind.value} copy to a rank without that store")
        store.replay(order)
