"""Which states a hybrid model's prefix cache keeps, where, and which go first.

A snapshot cache (stores/snapshots.py) resumes a request only where it holds the recurrent state,
and a request's prompt pieces end only where a state is known to be needed: a branch seen (a KV
match past the deepest snapshot), a little before the prompt's end (the next turn). The first
request on a new prefix cannot know where the next one will leave it, so without more the second
finds the prefix's KV but no state in it, computes it again, and only the third resumes. So, while
a request computes its prompt, the cache also keeps **checkpoints** (`plan_checkpoints`):

- **A ladder**: CHECKPOINT_FIRST tokens past where it resumed, then twice as far, four times, ...
  A later request sharing s >= CHECKPOINT_FIRST tokens of what it computed finds the deepest one
  inside its share, always more than half of it, at a cost of log2(s / 32) states per request
  (seven for a 2,048-token prompt) where the pool has room for them. Always for a request that
  computes its prompt from the root (a new prompt's first user); for one that resumed past it (a
  conversation's later turn) only while such ladders are resumed from (DEEP_LADDER_WINDOW).
- **The client's hints** (`Req.branch_hints`): the end of a chat's system turn, which every chat
  on the same system prompt shares (the chat API sends it for a hybrid model). Kept as a branch
  point, exactly where the next conversation branches.
- **Where a long prefill's chunk ends**: the request's row holds the state there anyway, between
  two steps; a checkpoint there costs one copy and no step.

None adds a prompt piece, so none adds a step: a position inside a piece is *captured*, its state
written into the snapshot slot by the forward pass as it passes it (`ScheduledBatch.state_captures`,
the Gated DeltaNet layer's rounds); one at a piece's end is copied from the row as a chunk end's is.

Which go first (`SnapshotEviction`): checkpoints are guesses, so they are evicted before every
other snapshot and never take a slot from one (a branch seen or a turn to come is worth more than
a guess); a full pool gives a checkpoint only a checkpoint's slot worth less. Within each class a
snapshot's worth is its saving per byte with recency (`checkpoint_worth`): log2 of the tokens a
request resuming there would not compute again (past the point its request kept below it: every
snapshot costs the same bytes, and below ~100,000 tokens of context a token's FLOPs barely depend
on where it is, attention being a quarter of these models' layers), plus its recency in turnovers
of the pool (a pool's worth of snapshot events), of when it was taken (a checkpoint) or last taken
or resumed from (a kept one): a snapshot saving twice the tokens lives one turnover longer. A
checkpoint a request resumes from has proven itself: it is kept from then on. A client's hint
counts a turnover more recent (it serves every chat on its system prompt, a prompt's end one
conversation). Whether the snapshots near prompts' ends and at sequences' ends pay is measured
(the share of them resumed from, by the request they were for or one resuming deeper on their
path, before they went): each is a guess (taken as a checkpoint) until its window is full and
shows they pay (single-question chats, whose users do not come back, would otherwise push out the
system prompts the next users share before their second users come), a sequence's end only now and
then once they do not. One refused a slot while its window learns still records its outcome (a
ghost: whether a later request's KV runs through its end), and one evicted from the device while
on probation goes to the host tier as a kept snapshot, unlike a checkpoint. A checkpoint taken does
not tick the recency clock (a request computing its prompt from the root ticks it once), and a
checkpoint a second user resumed from is a guess again once that user keeps the state where it
branched off below it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from radixserve.cache.lazy_heap import current_entries
from radixserve.cache.prefix_cache import TreeNode
from radixserve.cache.state_snapshots import StateSnapshots

# A request that kept a snapshot near its prompt's end takes another where its sequence ends only
# while they pay: while at least SEQUENCE_END_MIN_SHARE of the last SEQUENCE_END_WINDOW such
# snapshots to be resumed from or to go were resumed from (a client that sends the replies back as
# they were generated), else about one leaving request in SEQUENCE_END_PROBE, to notice when they do.
# An agent whose history is rendered anew (tool calls, reasoning dropped) diverges before the
# reply: there the second snapshot is a slot taken from another conversation. Until the window is
# full each is a guess (a checkpoint) on probation; one refused a slot still records whether a
# later request's KV ran through its end (`_ghost_end`), so the window learns as fast as when each was kept.
SEQUENCE_END_WINDOW = 16
SEQUENCE_END_MIN_SHARE = 0.25
SEQUENCE_END_PROBE = 8
# A snapshot near a prompt's end is kept (evicted least recently used, with the branch points) once
# at least PROMPT_END_MIN_SHARE of the last PROMPT_END_WINDOW of them to be resumed from or to go
# were resumed from (a conversation's next turn: agents, chats that come back); else, and until the
# window is full, it is taken as a checkpoint (a guess, evicted first: single-question chats, whose prompt ends nobody
# resumes from, would otherwise push out the system prompts the next users share). A checkpoint
# resumed from is kept from then on and counts as resumed, so the window notices when they pay again.
PROMPT_END_WINDOW = 32
PROMPT_END_MIN_SHARE = 0.25
# A request resuming past the root (a conversation's later turn, a request after a cached system
# prompt) plans its ladder only while at least DEEP_LADDER_MIN_SHARE of the last DEEP_LADDER_WINDOW
# such checkpoints to be resumed from or to go were resumed from, else about one request in
# DEEP_LADDER_PROBE does, to notice when they pay. Nobody branches inside an agent's tool results or
# a chat's question, and each checkpoint inside a piece costs a round of the linear layers' mixing.
# A request computing a prefix from the root always plans it: that is a new shared prompt's first user.
DEEP_LADDER_WINDOW = 64
DEEP_LADDER_MIN_SHARE = 1 / 16
DEEP_LADDER_PROBE = 8
# The first checkpoint lies this many tokens past where a request resumed; each next one twice as
# far. A second request sharing a new prefix of at least this many tokens finds more than half of it.
CHECKPOINT_FIRST = 32


@dataclass(frozen=True)
class Checkpoint:
    position: int
    saves: int  # tokens past the keep point below it: what a request resuming here does not compute
    hinted: bool  # a client's hint: kept as a branch point, not a guess


def plan_checkpoints(resume_at: int, target_len: int, keep_points: Iterable[int], hints: Iterable[int], *,
                     ladder: bool = True, min_gap: int, page_size: int) -> tuple[Checkpoint, ...]:
    """Where a request resuming at `resume_at`, whose prompt pieces end at `keep_points`, keeps
    states on its way through its first `target_len` positions: its hints, then (with `ladder`) its
    ladder, each whole pages and at least `min_gap` tokens from every other point kept (a state that
    close to another saves a later request too little to pay for its slot; a hint only from resume_at)."""
    keep = set(keep_points)
    points = {resume_at, *keep}
    hinted: set[int] = set()
    rungs: set[int] = set()

    def fits(position: int) -> bool:
        return resume_at < position <= target_len and all(abs(position - p) >= min_gap for p in points)

    # A hint is where another request branches: kept even close to this request's own keep points
    # (its prompt's end serves its next turn, the hint the next chat), if it is past where it resumed.
    for hint in sorted(set(hints)):
        position = hint - hint % page_size
        if resume_at + min_gap <= position <= target_len and position not in points:
            hinted.add(position)
            points.add(position)
    step = CHECKPOINT_FIRST
    while ladder and resume_at + step <= target_len:
        position = resume_at + step - (resume_at + step) % page_size
        if fits(position):
            rungs.add(position)
            points.add(position)
        step *= 2
    ordered = sorted(points)
    return tuple(Checkpoint(position, position - below, position in hinted)
                 for below, position in zip(ordered, ordered[1:]) if position in hinted or position in rungs)


def checkpoint_worth(saves: int, clock: int, slots: int) -> float:
    """A checkpoint's worth when taken as the pool's `clock`-th state: log2 of the tokens it saves,
    plus one for every `slots` states taken before it (its recency: of two checkpoints, one saving
    twice the tokens is worth as much as one taken a pool's turnover later)."""
    return math.log2(max(saves, 1)) + clock / max(slots, 1)


def saves_below(position: int, points: Iterable[int]) -> Optional[int]:
    """Tokens from the deepest of `points` below position to it (None: none lies below)."""
    below = [p for p in points if p < position]
    return position - max(below) if below else None


class SnapshotEviction:
    """Which snapshots pay and which go first: the part of the snapshot store
    (`stores/snapshots.py`) that decides (its base: it reads the store's pool, `snapshots`, its
    heap of snapshots, `_snap_heap`, and each node's snapshot, `TreeNode.state`). Checkpoints first, then the kept snapshots, each the least worth first
    (`checkpoint_worth`; a client's hint a pool's turnover more recent); a snapshot a waiting
    request will resume from last. A full pool gives a checkpoint only the slot of a checkpoint
    worth less."""

    snapshots: StateSnapshots
    snapshots_held: int
    _snap_heap: list[tuple[tuple, TreeNode]]

    def _init_eviction(self) -> None:
        # Snapshot events so far (taken, hung on the tree, resumed from; never reset): the clock
        # every snapshot's recency is read on (a pool's turnover is about num_slots of them).
        self._state_clock = 0
        # Whether each of the last sequence-end snapshots was resumed from (True) or went unused.
        self._end_outcomes: deque[bool] = deque(maxlen=SEQUENCE_END_WINDOW)
        # The same of the snapshots taken near prompts' ends (PROMPT_END_WINDOW), and of the
        # checkpoints of ladders planned past the root (DEEP_LADDER_WINDOW).
        self._prompt_end_outcomes: deque[bool] = deque(maxlen=PROMPT_END_WINDOW)
        self._deep_ladder_outcomes: deque[bool] = deque(maxlen=DEEP_LADDER_WINDOW)
        # Sequence ends taken as guesses while their window learns that found no slot: the node each
        # would have hung on -> the clock when it would have been taken (`_ghost_end`).
        self._ghosts: dict[TreeNode, int] = {}
        # Which leaving rows probe: drawn, so that no regular pattern of requests (a turn and its
        # follow-up, leaving in turn) always puts the probe on the same kind; seeded: repeatable.
        self._probe = random.Random(0)

    def _recency(self, node: TreeNode) -> int:
        """A snapshot's recency now that it is taken or resumed from: the clock's next tick, one
        pool's turnover later for a client's hint (the end of a chat's system turn serves every
        conversation on that system prompt, a prompt's end one conversation). A checkpoint taken
        does not tick the clock (its request ticked it once, `_admitted_new`): a burst of new
        prompts (each with a ladder of seven or so) would otherwise age the checkpoints taken a few
        steps before by turnovers, and push them out before the users they were for come."""
        if node.state.worth is None:
            self._state_clock += 1
        return self._state_clock + (self.snapshots.num_slots if node.state.hinted else 0)

    def _admitted_new(self) -> None:
        """A request computing its prompt from the root was admitted: one tick of the clock for the
        checkpoints it will take (they tick it not each: `_recency`), so that a stream of new prompts
        still ages the checkpoints of those before."""
        self._state_clock += 1

    def _worth(self, saves: int) -> float:
        return checkpoint_worth(saves, self._state_clock, self.snapshots.num_slots)

    def _keeps_sequence_end(self, kept_chunk_end: bool) -> bool:
        """Whether a leaving row (that kept a snapshot at a chunk end: kept_chunk_end) takes a
        snapshot where its sequence ends (SEQUENCE_END_WINDOW)."""
        if not kept_chunk_end or len(self._end_outcomes) < SEQUENCE_END_WINDOW \
                or sum(self._end_outcomes) >= SEQUENCE_END_MIN_SHARE * SEQUENCE_END_WINDOW:
            return True
        return self._probe.random() < 1 / SEQUENCE_END_PROBE

    def _end_outcome(self, node: TreeNode, *, resumed: bool) -> None:
        """node's snapshot is resumed from, or goes: its window (if any) records which, once."""
        state = node.state
        if state is not None and state.window is not None:
            state.window.append(resumed)
            state.window = None

    def _ghost_end(self, node: TreeNode) -> None:
        """A sequence end taken as a guess while its window learns found no slot: its outcome is
        recorded all the same, so that the window learns at the rate it did when every one was kept
        (`_ghost_reached` when a request's KV match runs through node's end: it would have resumed
        there; unused once it is a pool's turnover old, as an unused snapshot would have gone, or
        once its node left the tree)."""
        self._expire_ghosts()
        self._ghosts.pop(node, None)
        self._ghosts[node] = self._state_clock
        if len(self._ghosts) > self.snapshots.num_slots:  # never more than the pool would have held
            self._end_outcomes.append(False)
            del self._ghosts[next(iter(self._ghosts))]

    def _ghost_reached(self, node: TreeNode) -> None:
        """A request's KV match runs through node's end: a ghost there would have been resumed from."""
        if self._ghosts.pop(node, None) is not None:
            self._end_outcomes.append(True)

    def _expire_ghosts(self) -> None:
        turnover = self.snapshots.num_slots
        while self._ghosts:
            node, taken = next(iter(self._ghosts.items()))
            if not node.removed and self._state_clock - taken < turnover:
                break
            del self._ghosts[node]
            self._end_outcomes.append(False)

    def _on_probation(self, node: TreeNode) -> bool:
        """Whether node's snapshot, taken as a guess, is an end snapshot on probation rather than a
        checkpoint on the way: a prompt's or a sequence's end taken while its window was learning
        (not full yet) or since it showed that they pay. Written back to the host tier like a kept
        snapshot (a conversation's next turn resumes there), where a checkpoint is not."""
        window = node.state.window
        if window is self._prompt_end_outcomes:
            return len(window) < PROMPT_END_WINDOW or self._prompt_ends_pay()
        if window is self._end_outcomes:
            return len(window) < SEQUENCE_END_WINDOW or self._sequence_ends_pay()
        return False

    def _plans_ladder(self, resume_at: int) -> bool:
        """Whether a request resuming at `resume_at` keeps a ladder of checkpoints (DEEP_LADDER_WINDOW)."""
        window = self._deep_ladder_outcomes
        if resume_at == 0 or len(window) < DEEP_LADDER_WINDOW or sum(window) >= DEEP_LADDER_MIN_SHARE * DEEP_LADDER_WINDOW:
            return True
        return self._probe.random() < 1 / DEEP_LADDER_PROBE

    def _prompt_ends_pay(self) -> bool:
        """Whether a snapshot near a prompt's end is kept rather than taken as a checkpoint
        (PROMPT_END_WINDOW): not until the window is full (unproven, a guess like the checkpoints:
        taken as kept, a burst of single-question chats' prompt ends would push out every new system
        prompt's checkpoints before its second user comes)."""
        window = self._prompt_end_outcomes
        return len(window) == PROMPT_END_WINDOW and sum(window) >= PROMPT_END_MIN_SHARE * PROMPT_END_WINDOW

    def _sequence_ends_proven(self) -> bool:
        """Whether the sequence-end snapshots' window is full: until then one is a guess (a checkpoint)."""
        return len(self._end_outcomes) == SEQUENCE_END_WINDOW

    def _sequence_ends_pay(self) -> bool:
        window = self._end_outcomes
        return len(window) == SEQUENCE_END_WINDOW and sum(window) >= SEQUENCE_END_MIN_SHARE * SEQUENCE_END_WINDOW

    def _snapshot_priority(self, node: TreeNode) -> tuple:
        # A snapshot some waiting request will resume from goes last; checkpoints (guesses) first;
        # in each class the least worth first: log2 of the tokens it saves, plus its recency in
        # turnovers of the pool (`checkpoint_worth`, of when it was taken for a checkpoint, of when
        # it was last taken or resumed from for a kept one). A kept one's recency is its own: the
        # snapshots above a conversation's latest one are touched by every match through them, yet
        # resume nobody once a deeper one exists.
        state = node.state
        if state.worth is not None:
            return (self._parked_at(node), False, state.worth)
        return (self._parked_at(node), True, checkpoint_worth(state.saves, state.used, self.snapshots.num_slots))

    @staticmethod
    def _parked_at(node: TreeNode) -> bool:
        """Whether a waiting request's usable match ends at node (each one counts on its whole path)."""
        return node.waiters > sum(child.waiters for child in node.children.values())

    def _push_snapshot(self, node: TreeNode) -> None:
        heapq.heappush(self._snap_heap, (self._snapshot_priority(node), node))
        if len(self._snap_heap) > 4 * self.snapshots_held + 1024:
            holding = {n for _, n in self._snap_heap if not n.removed and n.state is not None and n.state.slot is not None}
            self._snap_heap = [(self._snapshot_priority(n), n) for n in holding]
            heapq.heapify(self._snap_heap)

    def _alloc_snapshot(self, *, evict_waited: bool = False, worth: Optional[float] = None) -> Optional[int]:
        """A free snapshot slot, evicting one snapshot if there is none; None when none can go. A
        snapshot a waiting request will resume from goes only for another that is sure to be used
        (`evict_waited`: a load for a request being admitted): a snapshot taken in passing may
        never be, and trading one for the other is how a pool smaller than its conversations
        would thrash. worth: the slot is for a checkpoint of that worth, which may take only a
        checkpoint's slot worth less."""
        slot = self.snapshots.alloc()
        if slot is not None:
            return slot
        held: list[tuple[tuple, TreeNode]] = []  # offered again once this search is over
        for current, node in current_entries(
                self._snap_heap, self._snapshot_priority, held=self._snapshot_held, kept=held,
                gone=lambda n: n.removed or n.state is None or n.state.slot is None):
            if current[0] and not evict_waited:
                held.append((current, node))  # every snapshot left is waited for
                break
            if worth is not None and (current[1] or current[2] >= worth):
                held.append((current, node))  # every snapshot left is worth more than this checkpoint
                break
            self._evict_snapshot(node)
            break
        for entry in held:
            heapq.heappush(self._snap_heap, entry)
        return self.snapshots.alloc()

    def _evict_snapshot(self, node: TreeNode) -> None:
        """The pool needs room: node's snapshot goes (a host tier's cache keeps it there)."""
        self._drop_snapshot(node, removing=False)

    def _snapshot_held(self, node: TreeNode) -> bool:
        """Whether node's snapshot must stay (a load holds it)."""
        return False
