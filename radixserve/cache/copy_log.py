"""The copies rank 0 of a tensor-parallel engine makes for its prefix cache, recorded in issue order
for the other ranks to make on their own shards: host-tier KV loads and write-backs (on the copy
stream, numbered) and a hybrid model's recurrent-state snapshot copies (rows to snapshot slots and
back, device snapshots to the host tier and back, those on the copy stream and numbered with the
KV copies). One log for every kind, so the ranks replay
them in the order rank 0 issued them, whatever the kind; each store that copies writes into the
same log (`CopyLog`), and `replay` hands each order back to the store of its kind.

The storage tier's orders travel in the same log (cache/storage_shards.py): each rank writes its
own shard of a page rank 0 decided to store (from the same host or device slots), reads its shard
of the pages rank 0 decided to read, and puts what it read into the same host slots as rank 0."""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence


class CopyKind(enum.Enum):
    KV_LOAD = "kv_load"  # host KV slots -> device KV slots
    KV_WRITE_BACK = "kv_write_back"  # device KV slots -> host KV slots
    STATE_SAVE = "state_save"  # request state rows -> device snapshot slots
    STATE_RESTORE = "state_restore"  # device snapshot slots -> request state rows
    STATE_WRITE_BACK = "state_write_back"  # device snapshot slots -> host snapshot slots
    STATE_LOAD = "state_load"  # host snapshot slots -> device snapshot slots
    # The storage tier's (payload: what cache/storage_shards.py says for each).
    STORE_HOST_PAGE = "store_host_page"  # host KV slots -> one page record in this rank's store
    STORE_DEVICE_PAGE = "store_device_page"  # device KV slots -> one page record (at shutdown)
    STORE_HOST_STATE = "store_host_state"  # a host snapshot slot -> a snapshot record
    STORE_DEVICE_STATE = "store_device_state"  # a device snapshot slot -> a snapshot record (at shutdown)
    STORAGE_READ = "storage_read"  # read job `seq`: its records -> host KV slots dst (its snapshot: a buffer)
    STORAGE_ATTACH_STATE = "storage_attach_state"  # read job `seq`'s snapshot -> host snapshot slot dst[0]
    STORAGE_RELEASE = "storage_release"  # read job `seq` is done with
    STORAGE_DISCARD = "storage_discard"  # delete this rank's shards of the pages in the payload (start-up)

    @property
    def of_kv(self) -> bool:
        return self in (CopyKind.KV_LOAD, CopyKind.KV_WRITE_BACK)

    @property
    def of_storage(self) -> bool:
        return self.value.startswith(("store_", "storage_"))


@dataclass
class CopyOrder:
    """One copy (or batch of copies) as rank 0 issued it: src[i] -> dst[i] in the slots or rows
    `kind` names; `seq`: a host-tier copy's sequence number on rank 0's copy stream (KV, or a
    snapshot between the tiers: the ranks check they number it alike), a storage read's job
    number, 0 for the others; `payload`: a storage order's records, whether a snapshot write-back
    was staged."""
    kind: CopyKind
    src: array
    dst: array
    seq: int = 0
    payload: Any = None


def slot_array(slots: Sequence[int]) -> array:
    return array("q", slots)


class CopyLog:
    """Rank 0's copies since the last message to the other ranks, in issue order."""

    def __init__(self) -> None:
        self.orders: list[CopyOrder] = []

    def record(self, kind: CopyKind, src: array, dst: array, seq: int = 0, payload: Any = None) -> None:
        self.orders.append(CopyOrder(kind, src, dst, seq, payload))

    def take(self) -> list[CopyOrder]:
        taken, self.orders = self.orders, []
        return taken


class CopyIssuer(Protocol):
    """The copy stream another store's copies ride (host_pool.CopyEngine): numbered and completed
    in order with the host tier's KV copies, so one counter says which are done."""

    done_seq: int

    def issue(self, copy: Callable[[], None], *, waits: bool = True, uses: Sequence[Any] = ()) -> int: ...

    def wait(self, seq: int) -> None:
        """Block until copy seq (and every copy before it) has completed."""

    def drain(self) -> None: ...


class Replays(Protocol):
    """A store whose copies rank 0 records: it makes one of them on this rank's shard."""

    def replay(self, order: CopyOrder) -> None: ...


def replay(orders: Sequence[CopyOrder], kv: Optional[Replays], states: Optional[Replays],
           storage: Optional[Replays] = None) -> None:
    """Make rank 0's copies on this rank's shards, in rank 0's order: the KV ones on this rank's
    copy engine (host_pool.CopyEngine), the state ones on its snapshot pool (and its host tier's;
    state_snapshots.StateSnapshots), the storage tier's on its shard of the store
    (storage_shards.StorageReplica)."""
    for order in orders:
        store = kv if order.kind.of_kv else storage if order.kind.of_storage else states
        if store is None:
            raise RuntimeError(f"rank 0 sent a {order.kind.value} copy to a rank without that store")
        store.replay(order)
