"""The snapshot store: a hybrid model's recurrent-state snapshots beside the tree's KV
(`TreeNode.state`, a `Snapshot`), on the device and, with a host tier, on the host.

A hybrid model's linear-attention layers keep no KV: a request resumed after p cached tokens
needs their state after position p, which only a snapshot taken there can give
(`radixserve.cache.state_snapshots`). So the tree keeps, besides each node's KV, at most one
snapshot per node: the state after the node's last token (`TreeNode.state`). A match is usable
only up to the deepest node end holding one: `peek`, `match`, the LPM order, the prefix hold,
`cached_tokens` and `/kv_events` all see that usable length, never the KV beyond it.

Where snapshots are taken, so that later requests find them:

- **Near the end of a prompt**: a conversation's next turn rarely carries the previous sequence
  as it was computed: a client sending text re-tokenizes the prompt's last token together with
  the reply, an agent or a reasoning template renders the reply anew (tool calls, reasoning
  dropped). What it does carry is the previous prompt, less its end. So a request's prompt piece
  ends PROMPT_END_SLACK tokens (whole pages) before its prompt's end (`MatchResult.chunk_ends`),
  the step that computes that piece takes the state there (`take_state`), and the next turn
  resumes there, computing those few tokens again.
- **Where requests branch**: when a request's KV match runs past its usable match (a shared system
  prompt computed before, but no snapshot where this request leaves it), a piece ends exactly at
  the end of the KV match (when at least BRANCH_MIN_TOKENS would be saved, or the match is the
  whole prompt: the same prompt again), and the next request that branches off the same prefix
  resumes there. When the branching requests wait together (a burst on a new shared prompt: the
  in-batch deferral admits one and holds the rest), the one admitted ends a piece where the
  earliest one parked beside it branches off (`resume`'s `branch_at`), so none computes the shared
  part twice.
- **Where a sequence ended**: a request that leaves (finished, aborted, retracted) hangs its
  row's state on the node where the KV it gave the tree ends (`keep_states` with `state_len`): a
  client that sends the reply back as generated, or the request itself once it is readmitted,
  resumes there. A row holds one state, after its last computed position; with pages of more than
  one token it is kept only when that position ends a page (the tree holds whole pages). A row
  that kept a snapshot near its prompt's end takes this second one only while such snapshots are
  resumed from (SEQUENCE_END_WINDOW): for an agent they never are, and each would cost another
  conversation its snapshot. A request that will be admitted again (retracted for memory) always
  takes it: it resumes there itself instead of computing what it generated again.
- **On the way, where a later request may branch** (checkpoints, `radixserve.cache.snapshot_policy`):
  a ladder 32, 64, 128, ... tokens past where the request resumed, where a long prefill's chunk
  ends, and where the client hinted (`Req.branch_hints`: the end of a chat's system turn). So the
  *second* request sharing a new prefix already finds more than half of it (the hint: all of it),
  not only the third. No piece ends at them: `capture_states` hands the forward pass the positions
  inside a piece and the slots it writes their states into (`ScheduledBatch.state_captures`).

When a snapshot is copied, and what the store knows of each running request's state row:
`snapshot_rows.SnapshotRows`, the `RequestStates` side the store hands on.

Eviction (`snapshot_policy.SnapshotEviction`): snapshots have their own pool and budget. Taking
one when the pool is full evicts one snapshot: never one a waiting request will resume from (it is
sure to be used, the new one only may be); checkpoints first (a checkpoint takes only a
checkpoint's slot worth less, never a kept snapshot's), each class the least worth first: the
tokens it saves (log2) plus its recency in turnovers of the pool (a client's hint one turnover
more). A snapshot near a prompt's end or at a sequence's end is a checkpoint until its window shows that
such snapshots are resumed from (single-question chats: they are not); on probation meanwhile (a
host tier keeps it when the device evicts it, and one refused a slot still records its outcome). A checkpoint resumed from is kept from
then on. A snapshot's recency is its own (taken, resumed from), not its node's: a match through a node to a deeper snapshot does not use it, and a resume stops
counting once the resuming request keeps a deeper snapshot on a path that does not branch in
between (a conversation's earlier turns go before another conversation's latest). A snapshot on a
path a running request holds may go too: that request's row already holds its state. When none
can go, no snapshot is taken (never an error: a later request computes a little more). A node
evicted for KV frees its snapshot with it, and leaves without a snapshot are evicted for KV first
(their KV beyond the last snapshot can only be computed again by whoever needs it). Every snapshot
slot is owned exactly once: by a node, by the row of a running request that took it and has not
hung it on the tree yet, or by the free list (`CacheMemory.check`).

How these rules were chosen, and the memory split between running rows, snapshots and KV that
they need: the scheduler simulator's hybrid runs (`radixserve.bench.scheduler_sim --hybrid-27b`),
docs/runs/2026-12-05-hybrid-snapshot-policy.md; the rules in words: docs/internals.md.
The host tier's part (a node's snapshot written back to the host and loaded again) is
`host_snapshots.HostSnapshots`; a node's snapshot is on one tier at a time, one payload either way.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from radixserve.cache.prefix_cache import MatchResult, no_snapshot_stats
from radixserve.cache.snapshot_policy import SnapshotEviction
from radixserve.cache.state_snapshots import StateSnapshots
from radixserve.cache.stores.host_kv import HostKV
from radixserve.cache.stores.host_snapshots import HostSnapshots
from radixserve.cache.stores.snapshot_rows import SnapshotRows
from radixserve.cache.stores.snapshot_state import Snapshot, SnapshotCounters, device_slot
from radixserve.cache.tree import ALL, EMPTY_SLOTS, NAMESPACE, PARTIAL, PROMPT_END_SLACK, RadixTree, TreeNode

# A branch point is worth a prompt piece of its own (one more step for the request that computes
# it, and a snapshot slot) only when it saves each later sibling at least this many tokens.
BRANCH_MIN_TOKENS = 16


class SnapshotStore(SnapshotEviction):
    ranks_eviction = True

    def __init__(self, snapshots: StateSnapshots, host: Optional[HostSnapshots] = None, *, page_size: int = 1,
                 branch_min_tokens: int = BRANCH_MIN_TOKENS):
        self.snapshots = snapshots
        self.host = host  # the host tier's snapshot slots (None: no host tier)
        self.page_size = page_size
        self.branch_min_tokens = max(branch_min_tokens, page_size)
        self.counters = SnapshotCounters()
        self.requests = SnapshotRows(self)  # the running requests' state rows
        self.tree: RadixTree
        self.kv_host: Optional[HostKV] = None  # the KV's host tier, whose loads hold snapshots
        self.reset()

    def bind(self, tree: RadixTree, kv_host: Optional[HostKV]) -> None:
        self.tree, self.kv_host = tree, kv_host
        if self.host is not None:
            self.host.bind(self)

    def reset(self) -> None:
        """The tree was flushed: nothing held, and nothing learnt of the snapshots that went (a flush
        is no evidence that they would not have paid, and the engine's warm-up, whose throw-away
        prompts are never continued, ends with one: what they taught would refuse the first real
        conversations their sequence-end snapshots)."""
        self._init_eviction()
        self.snapshots_held = 0
        self._snap_heap: list[tuple[tuple, TreeNode]] = []
        # Snapshots (on either tier) each node and its subtree hold; absent: none.
        self._below: dict[TreeNode, int] = {}
        if self.host is not None:
            self.host.reset()

    def reset_counters(self) -> None:
        self.counters = SnapshotCounters()
        if self.host is not None:
            self.host.reset_counters()

    def page_floor(self, n: int) -> int:
        return n - n % self.page_size

    def below(self, node: TreeNode) -> int:
        return self._below.get(node, 0)

    # ------------------------------------------------------------------ lookups
    def _usable_walk(self, tokens: Sequence[int], namespace: Optional[str], *,
                     ready: bool = True) -> tuple[int, TreeNode, int]:
        """(usable length, the node it ends at, KV match length): the deepest node end on the KV
        match with a snapshot there, ready on the device (else on any tier: what a lookup for a
        waiting request counts)."""
        tree = self.tree
        usable, last, kv = 0, tree.namespace_root(namespace) or tree.root, 0
        on_device = True
        for node, n, pos in tree.walk(tokens, namespace):
            kv = pos + n
            # A ready match has its whole path ready (a host tier's device part is a tree from the root).
            on_device = on_device and self._ready(node)
            if n == len(node.key) and (on_device or not ready) and self._resumable(node, ready):
                usable, last = kv, node
        return usable, last, kv

    def _ready(self, node: TreeNode) -> bool:
        """Whether node's KV can be read now: on the device, not waiting for a load."""
        return node.value is not None and (self.kv_host is None or not self.kv_host.loading(node))

    def _resumable(self, node: TreeNode, ready: bool) -> bool:
        """A request can resume at node's end: it holds a snapshot (on the device, ready; on either
        tier when `ready` is False)."""
        state = node.state
        if state is None:
            return False
        if not ready:
            return state.held
        return state.slot is not None and self._ready(node) and not self._snapshot_held(node)

    def peek_park(self, tokens: Sequence[int], namespace: Optional[str]) -> tuple[int, TreeNode, object]:
        """The usable length, parked at its node under the child key of the next page: a snapshot
        hung below that child (or a removed one at the node) touches it."""
        if self.tree.namespace_root(namespace) is None:
            return 0, self.tree.root, (NAMESPACE, namespace)
        usable, last, _ = self._usable_walk(tokens, namespace, ready=False)
        if usable + self.page_size > len(tokens):
            return usable, last, PARTIAL  # nothing left to match
        return usable, last, self.tree.child_key(tokens, usable)

    def loadable_len(self, tokens: Sequence[int], namespace: Optional[str]) -> int:
        """How far a load back from the host is worth it: to the deepest snapshot on either tier
        (KV beyond it resumes nobody)."""
        return self._usable_walk(tokens, namespace, ready=False)[0]

    def match(self, tokens: Sequence[int], namespace: Optional[str]) -> MatchResult:
        """The usable prefix (its nodes accessed, none split: a snapshot sits at a node's end) and,
        where the KV match runs far enough past it, the end of the KV match as a chunk end. A host
        snapshot on the match's device part was brought back while the request waited (its
        admission: `HostSnapshots.fetch`); one still loading is not used."""
        tree = self.tree
        if self._ghosts:  # sequence ends that found no slot: this request would have resumed there
            self._expire_ghosts()
            for node, n, _ in tree.walk(tokens, namespace):
                if n == len(node.key):
                    self._ghost_reached(node)
        tick = tree.next_tick()
        usable, last, kv = self._usable_walk(tokens, namespace)
        pieces: list[torch.Tensor] = []
        node = last
        while node.parent is not None and node.namespace is None:
            node.last_access = tick
            node.hit_count += 1
            pieces.append(node.value)
            node = node.parent
        if last.lock_ref == 0 and tree.evictable_leaf(last):
            tree.push(last)  # its access time changed
        slots = torch.cat(pieces[::-1]) if pieces else EMPTY_SLOTS
        return MatchResult(usable, slots, last, self._chunk_ends(len(tokens), usable, kv), len(tokens))

    def _chunk_ends(self, target_len: int, usable: int, kv: int) -> tuple[int, ...]:
        """Where a request admitted on this match keeps its state: the end of its KV match (a
        branch point) and a little before the end of its prompt (its next turn), each only where
        it saves a later request at least branch_min_tokens over the resume point above it; the
        end of a KV match that is the whole prompt (the same prompt again: a retry, a benchmark)
        wherever it lies past the usable match."""
        ends: list[int] = []
        resume_at = usable
        if kv - usable >= self.branch_min_tokens or usable < kv == target_len:
            ends.append(kv)
            resume_at = kv
        # target_len is the prompt less its last token: the next turn re-tokenizes the prompt's end.
        prompt_end = self.page_floor(target_len + 1 - PROMPT_END_SLACK)
        if prompt_end - resume_at >= self.branch_min_tokens:
            ends.append(prompt_end)
        return tuple(ends)

    def on_reusable_path(self, node: TreeNode) -> bool:
        return self.below(node) > 0

    def reusable_len(self, tokens: Sequence[int], namespace: Optional[str]) -> int:
        """Along the KV match as long as a snapshot lies at or below the node reached."""
        length = 0
        for node, n, pos in self.tree.walk(tokens, namespace):
            if self.below(node) == 0:
                break
            length = pos + n
        return length

    # ------------------------------------------------------------------ a request's state row
    # The RequestStates side (cache/prefix_cache.py), kept by the rows (`snapshot_rows.SnapshotRows`).
    def resume(self, row: int, match: MatchResult, *, branch_at: int = 0,
               hints: Sequence[int] = ()) -> tuple[int, ...]:
        return self.requests.resume(row, match, branch_at=branch_at, hints=hints)

    def resumed_from_host(self, row: int) -> bool:
        return self.requests.resumed_from_host(row)

    def cancel_resume(self, row: int) -> None:
        self.requests.cancel_resume(row)

    def take_state(self, row: int, position: int) -> None:
        self.requests.take_state(row, position)

    def capture_states(self, row: int, start: int, end: int) -> list[tuple[int, int]]:
        return self.requests.capture_states(row, start, end)

    @property
    def queued_saves(self) -> set[int]:
        return self.requests.queued_saves

    def issue(self, row: Optional[int] = None) -> None:
        self.requests.issue(row)

    def keep_states(self, row: int, tokens: Sequence[int], *, namespace: Optional[str] = None,
                    state_len: Optional[int] = None, readmitted: bool = False) -> None:
        self.requests.keep_states(row, tokens, namespace=namespace, state_len=state_len, readmitted=readmitted)

    def discard_states(self, rows: Sequence[int]) -> None:
        self.requests.discard_states(rows)


    # ------------------------------------------------------------------ the tree's snapshots
    def _attach(self, node: Optional[TreeNode], slot: int, *,
                worth: Optional[float] = None, hinted: bool = False, saves: int = 1) -> bool:
        """Hang a taken snapshot (a checkpoint's when worth is given; where a client hinted a branch,
        when hinted; saving `saves` tokens) on the node its position ends (freed if that node has
        one); whether the node holds a snapshot now. A device snapshot taken where the host tier
        holds one replaces it (the same state, ready on the device)."""
        if node is not None and not node.removed and node.value is not None and node.state is not None \
                and node.state.host_slot is not None:
            self.host.replaced(node)
        if node is None or node.removed or device_slot(node) is not None or node.value is None:
            self._free_slot(slot)
            return node is not None and not node.removed and device_slot(node) is not None
        state = node.state
        if state is None:
            state = node.state = Snapshot(slot)
        else:  # the host snapshot it replaces: what it measured (its window) goes on
            state.slot = slot
        state.worth, state.hinted, state.saves = worth, hinted, saves
        state.used = self._recency(node)
        self.snapshots_held += 1
        self.count_below(node, +1)
        self._push_snapshot(node)
        tree = self.tree
        tree.push_if_evictable(node)  # its eviction class changed
        # Lookups parked above it whose next page leads here may now resume deeper.
        child, above = node, node.parent
        while above is not None and child.namespace is None:
            tree.touched.add((above, tree.child_key(child.key, 0)))
            child, above = above, above.parent
        if tree.events is not None:
            tree.events.usable(node)
        return True

    def _drop_snapshot(self, node: TreeNode, *, removing: bool) -> None:
        """Free a node's device snapshot (evicted: the pool needs room, or the node leaves the tree)."""
        self._free_slot(node.state.slot)
        self._end_outcome(node, resumed=False)
        node.state = None
        self.snapshots_held -= 1
        self.counters.evictions += 1
        self.count_below(node, -1)
        self.tree.touched.add((node, ALL))  # lookups that resumed here
        if removing:
            return  # the tree's own removal re-offers the parent and publishes the eviction
        self.lost(node)

    def lost(self, node: TreeNode) -> None:
        """node's only snapshot was freed (it stays in the tree): it goes for KV sooner, and
        /kv_events hears of its path when no snapshot is left at or below it."""
        tree = self.tree
        if node.value is not None:
            tree.push_if_evictable(node)  # its eviction class changed
        if self.below(node) == 0 and tree.events is not None:
            tree.events.unusable(node)

    def count_below(self, node: Optional[TreeNode], delta: int) -> None:
        below = self._below
        while node is not None:
            count = below.get(node, 0) + delta
            if count:
                below[node] = count
            else:
                del below[node]
            node = node.parent

    def _free_slot(self, slot: int) -> None:
        """Free a snapshot slot a node held or a row took. Its copy out of a row may still be queued
        (a running request's chunk end, copied at the next poll): it is cancelled, or it would
        overwrite whatever the slot is taken for next."""
        self.requests.cancel_copies(slot)
        self.snapshots.free(slot)

    def _evict_snapshot(self, node: TreeNode) -> None:
        """The device pool needs room: node's snapshot moves to the host tier (its KV stays on the
        device), or is dropped when no host slot can be had."""
        if self.host is None or not self.host.to_host(node):
            self._drop_snapshot(node, removing=False)

    def _snapshot_held(self, node: TreeNode) -> bool:
        """A load holds node's snapshot: its KV, or the snapshot itself, is being copied back from the host."""
        return ((self.kv_host is not None and self.kv_host.loading(node))
                or (self.host is not None and self.host.loading(node)))

    # ------------------------------------------------------------------ the tree's hooks
    def eviction_rank(self, node: TreeNode) -> tuple:
        # Leaves without a snapshot go first: their KV past the last snapshot resumes nobody.
        state = node.state
        return (state is not None and state.held,)

    def on_split(self, upper: TreeNode, lower: TreeNode, n: int) -> None:
        count = self._below.get(lower)
        if count:
            self._below[upper] = count  # the snapshot at the node's end stays with the lower part

    def on_remove(self, node: TreeNode) -> None:
        state = node.state
        if state is None:
            return
        if state.host_slot is not None:
            self.host.free(node)
            self.count_below(node, -1)
        elif state.slot is not None:
            self._drop_snapshot(node, removing=True)

    def after_remove(self, node: TreeNode, parent: TreeNode) -> None:
        return None

    def leaves_device(self, node: TreeNode) -> None:
        """The device evicts node (its KV on the host now): its snapshot goes to the host too."""
        if device_slot(node) is not None and (self.host is None or not self.host.to_host(node)):
            self._drop_snapshot(node, removing=False)

    def on_flush(self, node: TreeNode) -> None:
        state = node.state
        if state is None:
            return
        if state.host_slot is not None:
            self.host.snapshots.free(state.host_slot)
        if state.slot is not None:
            self._free_slot(state.slot)
        node.state = None

    # ------------------------------------------------------------------ stats and checks
    def stats(self) -> dict[str, float]:
        c = self.counters
        stats = {**no_snapshot_stats(), "snapshot_slots": self.snapshots.num_slots,
                 "snapshots_held": self.snapshots_held,
                 "snapshot_bytes": self.snapshots_held * self.snapshots.bytes_per_slot, "snapshot_hits": c.hits,
                 "snapshots_taken": c.taken, "snapshot_evictions": c.evictions,
                 "checkpoints_taken": c.checkpoints_taken, "checkpoint_hits": c.checkpoint_hits}
        if self.host is not None:
            stats.update(self.host.stats())
        return stats

    def check(self, held_by_running: int, running_slots: Sequence[torch.Tensor], running_rows: Sequence[int]) -> None:
        """Every snapshot slot owned once (a node, a running request's row, the free list), the
        subtree counts right, every snapshot offered for eviction, and rows known exactly for the
        running requests; the host tier's snapshots likewise."""
        tree = self.tree
        owned: list[int] = []
        below: dict[int, int] = {}
        nodes = list(tree.iter_nodes())
        for node in nodes:
            state = node.state
            if state is None or not state.held:
                continue
            assert node is not tree.root and node.namespace is None, f"{node}: a root holds a snapshot"
            assert state.slot is None or state.host_slot is None, f"{node} holds a snapshot on both tiers"
            if state.slot is not None:
                assert node.value is not None, f"{node} holds a device snapshot but no device KV"
                owned.append(state.slot)
            up: Optional[TreeNode] = node
            while up is not None:
                below[id(up)] = below.get(id(up), 0) + 1
                up = up.parent
        for node in nodes:
            assert self.below(node) == below.get(id(node), 0), \
                f"{node}: {self.below(node)} snapshots below, counted {below.get(id(node), 0)}"
        assert len(owned) == self.snapshots_held, f"held counter {self.snapshots_held} != {len(owned)}"
        offered = {id(n) for _, n in self._snap_heap}
        assert all(id(n) in offered for n in nodes if device_slot(n) is not None), "a snapshot can never be evicted"
        owned.extend(self.requests.owned_slots())
        owned.extend(self.snapshots.free_slot_list())
        assert sorted(owned) == list(range(self.snapshots.num_slots)), "a snapshot slot is owned twice or by no one"
        self.requests.check(running_rows)
        if self.host is not None:
            self.host.check(nodes)
