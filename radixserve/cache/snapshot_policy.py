"""Checkpoints: the states a hybrid model's prefix cache keeps on a request's way through its
prompt, so that the *second* request sharing a new prefix finds it.

A snapshot cache (snapshot_cache.py) resumes a request only where it holds the recurrent state,
and a request's prompt pieces end only where a state is known to be needed: a branch seen (a KV
match past the deepest snapshot), a little before the prompt's end (the next turn). The first
request on a new prefix cannot know where the next one will leave it, so without more the second
finds the prefix's KV but no state in it, computes it again, and only the third resumes. So, while
a request computes its prompt, the cache also keeps:

- **A ladder of checkpoints**: CHECKPOINT_FIRST tokens past where it resumed, then twice as far,
  four times, ... A later request sharing s >= CHECKPOINT_FIRST tokens of what it computed finds
  the deepest one inside its share, always more than half of it, at a cost of log2(s / 32) states
  per request (seven for a 2,048-token prompt).
- **The client's hints** (`Req.branch_hints`): the end of a chat's system turn, which every chat
  on the same system prompt shares (the chat API marks it for a hybrid model). Kept as a branch
  point, exactly where the next conversation branches.
- **Where a long prefill's chunk ends**: the request's row holds the state there anyway, between
  two steps; a checkpoint there costs one copy and no step.

Neither kind adds a prompt piece, so no step: a position inside a piece is *captured*, its state
written into the snapshot slot by the forward pass as it passes it (`ScheduledBatch.state_captures`,
the Gated DeltaNet layer's rounds); one at a piece's end is copied from the row as a chunk end's is.

What they may take: checkpoints are guesses, so they are evicted before every other snapshot and
never take a slot from one (a branch seen or a turn to come is worth more than a guess); a full
pool gives a checkpoint only a checkpoint's slot worth less. Worth is the expected saving per byte
with recency: the tokens a request resuming there would not compute again (past the keep point below
it: every snapshot costs the same bytes, and below ~100,000 tokens of context a token's FLOPs barely
depend on where it is, attention being a quarter of these models' layers), halved for every
turnover of the pool since it was taken (a pool's worth of states taken after it). A checkpoint a
request resumes from has proven itself: it becomes a kept snapshot. The client's hints are kept
snapshots from the start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

# The first checkpoint lies this many tokens past where a request resumed; each next one twice as
# far. A second request sharing a new prefix of at least this many tokens finds more than half of it.
CHECKPOINT_FIRST = 32


@dataclass(frozen=True)
class Checkpoint:
    position: int
    saves: int  # tokens past the keep point below it: what a request resuming here does not compute
    hinted: bool  # a client's hint: kept as a branch point, not a guess


def plan_checkpoints(resume_at: int, target_len: int, keep_points: Iterable[int], hints: Iterable[int], *,
                     min_gap: int, page_size: int) -> tuple[Checkpoint, ...]:
    """Where a request resuming at `resume_at`, whose prompt pieces end at `keep_points`, keeps
    states on its way through its first `target_len` positions: its hints, then its ladder, each
    whole pages and at least `min_gap` tokens from every other point kept (a state that close to
    another saves a later request too little to pay for its slot)."""
    keep = set(keep_points)
    points = {resume_at, *keep}
    hinted: set[int] = set()
    ladder: set[int] = set()

    def fits(position: int) -> bool:
        return resume_at < position <= target_len and all(abs(position - p) >= min_gap for p in points)

    for hint in sorted(set(hints)):
        position = hint - hint % page_size
        if fits(position):
            hinted.add(position)
            points.add(position)
    step = CHECKPOINT_FIRST
    while resume_at + step <= target_len:
        position = resume_at + step - (resume_at + step) % page_size
        if fits(position):
            ladder.add(position)
            points.add(position)
        step *= 2
    ordered = sorted(points)
    return tuple(Checkpoint(position, position - below, position in hinted)
                 for below, position in zip(ordered, ordered[1:]) if position in hinted or position in ladder)


def checkpoint_worth(saves: int, clock: int, slots: int) -> float:
    """A checkpoint's worth when taken as the pool's `clock`-th state: log2 of the tokens it saves,
    plus one for every `slots` states taken before it (its recency: of two checkpoints, one saving
    twice the tokens is worth as much as one taken a pool's turnover later)."""
    return math.log2(max(saves, 1)) + clock / max(slots, 1)


def saves_below(position: int, points: Iterable[int]) -> Optional[int]:
    """Tokens from the deepest of `points` below position to it (None: none lies below)."""
    below = [p for p in points if p < position]
    return position - max(below) if below else None
