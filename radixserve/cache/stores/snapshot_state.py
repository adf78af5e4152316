"""What the snapshot store (stores/snapshots.py) keeps: a node's snapshot (`Snapshot`, the
payload in `TreeNode.state`), what it knows of a running request's state row (`RowStates`, kept
by stores/snapshot_rows.py), and its counters."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from radixserve.cache.snapshot_policy import Checkpoint
from radixserve.cache.tree import TreeNode


@dataclass(slots=True)
class Snapshot:
    """A node's snapshot: the recurrent state after its last token, in a device slot or (with a
    host tier) a host slot, never both; and what the eviction policy knows of it."""
    slot: Optional[int]  # device snapshot slot (None: on the host)
    host_slot: Optional[int] = None  # host snapshot slot (only while not on the device)
    # When it was last taken or resumed from, on the store's clock of snapshot events (its own
    # recency: a match through the node to a deeper snapshot is no use of this one).
    used: int = 0
    # Of a kind whose pay-off is measured (taken where a sequence ended, a little before a prompt's
    # end, a checkpoint deep in a conversation: snapshot_policy.py): the window of outcomes that
    # records whether a request resumes from it before it goes.
    window: Optional[deque] = None
    # A checkpoint's worth (a guess where a later request may branch, snapshot_policy.py): it is
    # evicted before any other snapshot, the least worth first. None: a snapshot kept for a reason
    # (a branch seen, a turn to come, a client's hint), evicted least recently used.
    worth: Optional[float] = None
    hinted: bool = False  # it lies where a client said requests branch (the end of a chat's system turn)
    # The tokens a request resuming here does not compute again, past the point kept below it by
    # the request that took it: what the snapshot is worth (snapshot_policy.py).
    saves: int = 1
    from_host: bool = False  # loaded back from the host and no request resumed from it yet
    loading_seq: int = 0  # the copy that loaded it back (usable once the copy engine saw it done)
    written_seq: int = 0  # the copy that wrote it into its host slot (the slot is read once it is done)

    @property
    def held(self) -> bool:
        """On either tier (a load back to the device takes it off the host first)."""
        return self.slot is not None or self.host_slot is not None


@dataclass
class RowStates:
    """What the store knows of a running request's state row."""
    chunk_ends: tuple[int, ...]
    # (position, snapshot slot) taken of the row and not hung on the tree yet.
    taken: list[tuple[int, int]] = field(default_factory=list)
    # Where it keeps states on its way without ending a piece there (snapshot_policy.py), and how
    # far its prompt runs (no checkpoint past it).
    checkpoints: tuple[Checkpoint, ...] = ()
    target_len: int = 0
    # Positions kept or planned so far (its resume point, chunk ends, checkpoints, chunk boundaries):
    # what a new checkpoint saves is measured from the deepest one below it.
    points: set[int] = field(default_factory=set)
    # Of the taken slots: the checkpoints' worth (absent: a kept snapshot), and those the forward
    # pass writes (captured inside a piece: not copied from the row).
    worth: dict[int, float] = field(default_factory=dict)
    captured: set[int] = field(default_factory=set)
    hinted: set[int] = field(default_factory=set)  # of the kept ones, those at a client's hint
    valid: bool = True  # False after discard_states: its state may be wrong
    kept_chunk_end: bool = False  # a snapshot lies at one of its chunk ends, kept by this row
    prompt_end: int = 0  # the chunk end a little before its prompt's end (0: none)
    prompt_end_slot: Optional[int] = None  # the slot taken there
    deep_ladder: bool = False  # it keeps a ladder of checkpoints past the root (their pay-off is measured)
    # The node it resumed from and that snapshot's recency before: once the row hangs a deeper
    # snapshot on a path that does not branch there, the old one gets that recency back.
    resumed_from: Optional[TreeNode] = None
    used_before: int = 0
    worth_before: Optional[float] = None  # that snapshot's worth, a checkpoint's (None: a kept one)
    from_host: bool = False  # the snapshot it resumed from was loaded back from the host tier


@dataclass
class SnapshotCounters:
    hits: int = 0  # admissions resumed from a snapshot
    taken: int = 0  # snapshots copied out of a request row (or written there by the forward pass)
    evictions: int = 0  # snapshots freed to make room or with their node
    checkpoints_taken: int = 0  # of those taken, checkpoints (snapshot_policy.py)
    checkpoint_hits: int = 0  # of the hits, resumed from a checkpoint (it is kept from then on)


def device_slot(node: TreeNode) -> Optional[int]:
    """node's device snapshot slot (None: it holds none on the device)."""
    state = node.state
    return state.slot if state is not None else None
