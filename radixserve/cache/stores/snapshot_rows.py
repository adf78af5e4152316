"""The request rows' side of the snapshot store (stores/snapshots.py): what it knows of each
running request's state row (`RowStates`) and the copies out of the rows still queued; the
`RequestStates` protocol of cache/prefix_cache.py, which the store hands on to `SnapshotRows`.

A row is filled from the snapshot its request resumes from (`resume`), takes states where its
prompt pieces end (`take_state`) and where the forward pass captures checkpoints inside a piece
(`capture_states`), and hangs them on the tree through the store when its KV is inserted or it
leaves (`keep_states`). Where the snapshots are taken and why: the store's docstring.

When a snapshot is copied: a restore into an admitted request's row at once (`resume`); a
checkpoint inside a piece by that step's forward pass itself; the state at a chunk end (or a
checkpoint at a piece's end) once the step that computes it is launched: `take_state` is called
while that step is being scheduled, and the copy is issued at the next `poll` (the start of the
next step's scheduling, before any later forward pass advances the row) or when the row is given
back; the state at a sequence's end at once, when the request leaves (every step that advanced its
row is already queued before). A step that failed part-way leaves its rows' states suspect:
`discard_states` cancels what they had not copied yet, frees the checkpoints their forward passes
were to write, and takes nothing more from them. A slot freed while its copy is still queued has
the copy cancelled (`cancel_copies`).
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Protocol, Sequence

from radixserve.cache.prefix_cache import MatchResult
from radixserve.cache.snapshot_policy import plan_checkpoints, saves_below
from radixserve.cache.state_snapshots import StateSnapshots
from radixserve.cache.stores.host_snapshots import HostSnapshots
from radixserve.cache.stores.snapshot_state import RowStates, SnapshotCounters, device_slot
from radixserve.cache.tree import PROMPT_END_SLACK, RadixTree, TreeNode


class RowOwner(Protocol):
    """What of the snapshot store its request rows use: the pool and the tree, where a taken state
    is hung (`_attach`), and the eviction policy that gives slots and prices them
    (`snapshot_policy.SnapshotEviction`)."""
    snapshots: StateSnapshots
    host: Optional[HostSnapshots]  # the host tier (None: none): its hits are counted here
    tree: RadixTree
    counters: SnapshotCounters
    page_size: int
    branch_min_tokens: int
    _end_outcomes: deque
    _prompt_end_outcomes: deque
    _deep_ladder_outcomes: deque

    def page_floor(self, n: int) -> int: ...

    def _attach(self, node: Optional[TreeNode], slot: int, *,
                worth: Optional[float] = None, hinted: bool = False, saves: int = 1) -> bool: ...

    def _alloc_snapshot(self, *, evict_waited: bool = False, worth: Optional[float] = None) -> Optional[int]: ...

    def _worth(self, saves: int) -> float: ...

    def _recency(self, node: TreeNode) -> int: ...

    def _push_snapshot(self, node: TreeNode) -> None: ...

    def _end_outcome(self, node: TreeNode, *, resumed: bool) -> None: ...

    def _ghost_end(self, node: TreeNode) -> None: ...

    def _admitted_new(self) -> None: ...

    def _plans_ladder(self, resume_at: int) -> bool: ...

    def _prompt_ends_pay(self) -> bool: ...

    def _keeps_sequence_end(self, kept_chunk_end: bool) -> bool: ...

    def _sequence_ends_proven(self) -> bool: ...


class SnapshotRows:
    """The running requests' state rows of a snapshot store (`RequestStates`)."""

    def __init__(self, store: RowOwner):
        self.store = store
        self.snapshots = store.snapshots
        self.rows: dict[int, RowStates] = {}
        # (row, slot): states taken for the step being scheduled, copied once it is launched.
        self._unissued: list[tuple[int, int]] = []

    def resume(self, row: int, match: MatchResult, *, branch_at: int = 0,
               hints: Sequence[int] = ()) -> tuple[int, ...]:
        store = self.store
        assert row not in self.rows, f"state row {row} was not given back"
        node = match.last_node
        from_host = bool(match.length) and node.state.from_host
        if from_host:
            node.state.from_host = False
            store.host.counters.hits += 1
        if not match.length:
            store._admitted_new()
        chunk_ends = self._with_branch(match, branch_at)
        ladder = store._plans_ladder(match.length)
        checkpoints = plan_checkpoints(match.length, match.target_len, chunk_ends, hints, ladder=ladder,
                                       min_gap=store.branch_min_tokens, page_size=store.page_size)
        prompt_end = store.page_floor(match.target_len + 1 - PROMPT_END_SLACK)
        states = self.rows[row] = RowStates(chunk_ends, checkpoints=checkpoints, target_len=match.target_len,
                                            points={match.length, *chunk_ends, *(c.position for c in checkpoints)},
                                            prompt_end=prompt_end if prompt_end in chunk_ends else 0,
                                            deep_ladder=ladder and match.length > 0)
        if match.length:
            state = node.state
            slot = state.slot if state is not None else None
            assert slot is not None, f"a usable match ends at {match.last_node}, which holds no snapshot"
            if any(s == slot for _, s in self._unissued):
                self.issue()  # hung on the tree by a launched step whose copy is still queued here
            self.snapshots.restore([slot], [row])
            store.counters.hits += 1
            store._end_outcome(node, resumed=True)
            self._conversation_came_back(node)
            states.resumed_from, states.used_before = node, state.used
            states.worth_before = state.worth
            if state.worth is not None:  # a checkpoint resumed from has proven itself
                store.counters.checkpoint_hits += 1
                state.worth = None
            state.used = store._recency(node)
            store._push_snapshot(node)
        states.from_host = from_host
        return states.chunk_ends

    def resumed_from_host(self, row: int) -> bool:
        states = self.rows.get(row)
        return states is not None and states.from_host

    def cancel_resume(self, row: int) -> None:
        states = self.rows[row]
        if states.from_host:
            self.store.host.counters.hits -= 1
            if states.resumed_from.state is not None:
                states.resumed_from.state.from_host = True
        del self.rows[row]
        assert not states.taken, f"state row {row} was scheduled before its admission was undone"
        node = states.resumed_from
        if node is not None:
            self.store.counters.hits -= 1
            self.store.counters.checkpoint_hits -= states.worth_before is not None
            if device_slot(node) is not None:
                node.state.used, node.state.worth = states.used_before, states.worth_before
                self.store._push_snapshot(node)

    def _with_branch(self, match: MatchResult, branch_at: int) -> tuple[int, ...]:
        """match's chunk ends and, where a waiting request will branch off this one's prompt (both
        wait to be computed: a burst of prompts on a new shared prefix), the branch point too, so
        that the second one resumes there instead of computing the shared part again; only where it
        lies at least branch_min_tokens from the match and every other chunk end."""
        at = self.store.page_floor(branch_at)
        ends = match.chunk_ends
        if all(abs(at - end) >= self.store.branch_min_tokens for end in (match.length, *ends)) and at > match.length:
            return tuple(sorted((*ends, at)))
        return ends

    def take_state(self, row: int, position: int) -> None:
        self._take_row_state(row, position)

    def _take_row_state(self, row: int, position: int, *, worth: Optional[float] = None,
                        hinted: bool = False) -> None:
        """take_state; worth: a checkpoint's (None: a kept snapshot's); hinted: at a client's hint."""
        states = self.rows[row]
        if not states.valid or any(p == position for p, _ in states.taken):
            return
        at_prompt_end = position == states.prompt_end
        if at_prompt_end and not self.store._prompt_ends_pay():
            worth = self.store._worth(saves_below(position, states.points) or position)
        slot = self._take_slot(states, position, worth, hinted)
        if slot is not None:  # no room: the next request branching there computes it again
            self._unissued.append((row, slot))
            if at_prompt_end:
                states.prompt_end_slot = slot

    def capture_states(self, row: int, start: int, end: int) -> list[tuple[int, int]]:
        """The checkpoints in (start, end) the pool has room for, each captured by the forward pass;
        one at `end`, or `end` itself where a long prefill's chunk ends inside the prompt, copied
        from the row as a chunk end's state is."""
        states = self.rows[row]
        if not states.valid:
            return []
        captures = []
        # The ones that save most first: where the pool has room for only some, they get it.
        for checkpoint in sorted(states.checkpoints, key=lambda c: (c.hinted, c.saves, c.position), reverse=True):
            if not start < checkpoint.position <= end:
                continue
            worth = None if checkpoint.hinted else self.store._worth(checkpoint.saves)
            if checkpoint.position == end:
                self._take_row_state(row, end, worth=worth, hinted=checkpoint.hinted)
                continue
            slot = self._take_slot(states, checkpoint.position, worth, checkpoint.hinted)
            if slot is not None:
                states.captured.add(slot)
                captures.append((checkpoint.position, slot))
                self.store.counters.taken += 1
        captures.sort()
        saves = saves_below(end, states.points)
        if end < states.target_len and saves is not None and end % self.store.page_size == 0 \
                and all(abs(end - p) >= self.store.branch_min_tokens for p in states.points):
            states.points.add(end)  # a chunk boundary: the row holds the state there anyway
            self._take_row_state(row, end, worth=self.store._worth(saves))
        return captures

    def _take_slot(self, states: RowStates, position: int, worth: Optional[float],
                   hinted: bool = False) -> Optional[int]:
        """A slot for the state at `position` of the row (a checkpoint's when worth is given; at a
        client's hint when hinted), owned by the row until it is hung on the tree; None when the
        pool has none to give it."""
        slot = self.store._alloc_snapshot(worth=worth)
        if slot is None:
            return None
        states.taken.append((position, slot))
        if hinted:
            states.hinted.add(slot)
        if worth is not None:
            states.worth[slot] = worth
            self.store.counters.checkpoints_taken += 1
        return slot

    @property
    def queued_saves(self) -> set[int]:
        """Snapshot slots whose copy out of a row is still queued here (their contents are not yet
        the state they will hold)."""
        return {slot for _, slot in self._unissued}

    def issue(self, row: Optional[int] = None) -> None:
        """Copy the taken states not copied yet (of `row` only, when given). At the start of a
        step's scheduling (`poll`), the steps that reached a chunk end are launched, so their
        states are copied out now, before a later forward pass moves their rows on."""
        if row is None:
            batch, self._unissued = self._unissued, []
        else:
            batch = [e for e in self._unissued if e[0] == row]
            self._unissued = [e for e in self._unissued if e[0] != row]
        if batch:
            self.snapshots.save([r for r, _ in batch], [s for _, s in batch])
            self.store.counters.taken += len(batch)

    def keep_states(self, row: int, tokens: Sequence[int], *, namespace: Optional[str] = None,
                    state_len: Optional[int] = None, readmitted: bool = False) -> None:
        store = self.store
        states = self.rows[row]
        leaving = state_len is not None
        if leaving:
            self.issue(row)  # the row goes to another request next: its state is read now
        n = len(tokens)
        waiting = []
        for position, slot in states.taken:
            if 0 < position <= n:
                worth = states.worth.pop(slot, None)
                states.captured.discard(slot)
                node = store.tree.node_ending_at(tokens, position, namespace)
                if store._attach(node, slot, worth=worth, hinted=slot in states.hinted,
                                saves=saves_below(position, states.points) or position):
                    if device_slot(node) == slot and slot == states.prompt_end_slot:
                        node.state.window = store._prompt_end_outcomes  # whether they pay
                    elif device_slot(node) == slot and worth is not None and states.deep_ladder:
                        node.state.window = store._deep_ladder_outcomes
                    if position in states.chunk_ends:
                        states.kept_chunk_end = True
                    if position in states.chunk_ends or worth is None:  # not a guess on the way
                        self._superseded(states)
            else:
                waiting.append((position, slot))
        states.taken = waiting
        if not leaving:
            return
        if states.valid and state_len == n and n > 0 and (readmitted or store._keeps_sequence_end(states.kept_chunk_end)):
            node = store.tree.node_ending_at(tokens, n, namespace)
            if node is not None and device_slot(node) is None:
                saves = saves_below(n, states.points) or n
                # A guess until such snapshots are known to pay (the window full), as a prompt's end.
                guess = states.kept_chunk_end and not readmitted and not store._sequence_ends_proven()
                worth = store._worth(saves) if guess else None
                slot = store._alloc_snapshot(worth=worth)
                if slot is not None:
                    self.snapshots.save([row], [slot])
                    store.counters.taken += 1
                    if store._attach(node, slot, saves=saves, worth=worth):
                        # Whether such snapshots pay is learnt from clients' next turns alone.
                        if states.kept_chunk_end and not readmitted:
                            node.state.window = store._end_outcomes
                        self._superseded(states)  # where no snapshot near its prompt's end did already
                elif guess:  # no slot for the guess: whether its next turn would have resumed there is learnt all the same
                    store._ghost_end(node)
        for _, slot in states.taken:
            self.snapshots.free(slot)
        del self.rows[row]

    def discard_states(self, rows: Sequence[int]) -> None:
        suspect = set(rows)
        cancelled = {e for e in self._unissued if e[0] in suspect}
        self._unissued = [e for e in self._unissued if e not in cancelled]
        for row in suspect:
            states = self.rows.get(row)
            if states is None:
                continue
            states.valid = False
            # Queued copies are cancelled; the states its steps' forward passes were to write are suspect.
            for entry in [(p, s) for p, s in states.taken if (row, s) in cancelled or s in states.captured]:
                states.taken.remove(entry)
                states.captured.discard(entry[1])
                states.worth.pop(entry[1], None)
                self.snapshots.free(entry[1])

    def _conversation_came_back(self, node: TreeNode) -> None:
        """A request resumed at node: a snapshot near a prompt's end above it on its path paid too
        (its conversation came back, to a deeper state: the reply sent back as generated)."""
        node = node.parent
        while node is not None and node.parent is not None:
            if node.state is not None and node.state.window is self.store._prompt_end_outcomes:
                self.store._end_outcome(node, resumed=True)
            node = node.parent

    def _superseded(self, states: RowStates) -> None:
        """The row hung a snapshot below the one it resumed from: where nothing branches off between
        them, the old one resumes nobody the new one would not, and loses its resume's recency; a
        checkpoint it was (a second user's resume on a new prefix: the state where it branched is
        kept now) is a checkpoint again, evicted before the kept snapshots."""
        node, states.resumed_from = states.resumed_from, None
        if node is not None and device_slot(node) is not None and len(node.children) == 1 \
                and node.state.used > states.used_before:
            node.state.used = states.used_before
            if states.worth_before is not None:  # a checkpoint it proved: a guess again, the deeper one serves
                node.state.worth = states.worth_before
            self.store._push_snapshot(node)

    def cancel_copies(self, slot: int) -> None:
        """slot is freed: its copy out of a row still queued (a running request's chunk end, copied
        at the next poll) is cancelled, or it would overwrite whatever the slot is taken for next."""
        if any(s == slot for _, s in self._unissued):
            self._unissued = [e for e in self._unissued if e[1] != slot]

    def owned_slots(self) -> list[int]:
        """The snapshot slots the rows took and have not hung on the tree yet."""
        return [slot for states in self.rows.values() for _, slot in states.taken]

    def check(self, running_rows: Sequence[int]) -> None:
        """Rows known exactly for the running requests, and no copy queued for a row given back."""
        assert set(self.rows) == set(running_rows), f"state rows {sorted(self.rows)} != running {sorted(running_rows)}"
        assert {row for row, _ in self._unissued} <= set(self.rows), "a copy is queued for a row given back"
