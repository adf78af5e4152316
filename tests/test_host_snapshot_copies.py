"""A hybrid model's recurrent-state snapshots between the device and the host tier go on the host
tier's copy stream, numbered in its KV copies' sequence (cache/state_snapshots.py). On the CPU the
copies run at issue, but their completion is seen only by `poll`; these tests hold copies back
for a few polls (a slow copy stream) and check what must wait for them:

- a device snapshot slot written back is reusable at once while the write-back is staged (a few
  in flight); beyond those it is not handed out before its copy is seen done (only a load, queued
  after it on the same stream, may take it), nor is one a load still fills;
- a request resuming from a snapshot on the host waits in admission until its load is seen done,
  the load numbered right after its KV load, and gets transformers' greedy tokens;
- under tensor parallelism the snapshot copies travel in the one copy log with their numbers, and
  a rank replays them under the same numbers (a diverged one stops with an error).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from test_engine import GREEDY, check_idle, hf_greedy
from test_hybrid import qwen3_5  # noqa: F401  (the fixture)

from radixserve import Engine
from radixserve.cache.copy_log import CopyKind, CopyLog, replay
from radixserve.cache.factory import host_tier
from radixserve.cache.host_pool import CopyEngine
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.cache import state_snapshots
from radixserve.cache.state_snapshots import StateSnapshots

pytestmark = pytest.mark.timeout(300)

SPEC = RecurrentStateSpec(num_layers=2, conv_shape=(3, 4), ssm_shape=(2, 2, 2), conv_dtype=torch.float32,
                          ssm_dtype=torch.float32)


class SlowCopies:
    """A copy engine's completion test that sees each copy done only when `poll` asks about it for
    the `polls`-th time: a copy stream slower than the steps."""

    def __init__(self, copier: CopyEngine, polls: int = 3):
        self.asked: Counter = Counter()
        self.polls = polls
        copier._is_done = self  # type: ignore[method-assign]

    def __call__(self, event: object) -> bool:
        self.asked[event] += 1
        return self.asked[event] >= self.polls


def tier(slots: int = 2, host_slots: int = 4, fill: float = 0.0):
    """A device snapshot pool of `slots` over 2 request rows, under a host tier of `host_slots`."""
    rows = RecurrentStatePool(2, SPEC, "cpu")
    device = StateSnapshots(slots, rows)
    for layer in range(SPEC.num_layers):
        device.conv[layer].copy_(fill + torch.arange(slots, dtype=torch.float32)[:, None, None].expand_as(device.conv[layer]))
        device.ssm[layer].copy_(fill + torch.arange(slots, dtype=torch.float32)[:, None, None, None].expand_as(device.ssm[layer]))
    pool = KVPool(64, 1, 1, 1, 4, torch.float32, "cpu", state=rows, snapshots=device)
    host = host_tier(pool, 64, host_slots)
    assert host.snapshots is device.host and host.snapshots.copier is host.copier
    return device, host


def test_a_written_back_slot_is_not_handed_out_before_its_copy_is_done(monkeypatch):
    monkeypatch.setattr(state_snapshots, "STAGED_WRITE_BACKS", 2)
    device, host = tier(slots=3)
    copier = host.copier
    SlowCopies(copier)
    assert [device.alloc() for _ in range(3)] == [0, 1, 2]
    # Staged (gathered at issue), as long as few are in flight: the slot is reusable at once.
    staged = [host.snapshots.write_back([0], [0]), host.snapshots.write_back([1], [1])]
    device.free(0)
    assert device.alloc() == 0
    device.ssm[0][0].zero_()  # reused: the host still gets the state written back
    # Beyond STAGED_WRITE_BACKS in flight the copy reads the slot itself: it waits for the copy.
    assert len(staged) == state_snapshots.STAGED_WRITE_BACKS
    seq = host.snapshots.write_back([2], [2])
    device.free(2)
    assert device.free_slots == 1 and device.alloc() is None, "a slot was handed out while its copy reads it"
    polls = 0
    while copier.poll() < seq:
        assert device.alloc() is None, "a slot was handed out before its copy was seen done"
        polls += 1
    assert polls >= 2 and device.alloc() == 2  # free once its copy is seen done
    for h in range(3):
        assert torch.equal(host.snapshots.ssm[0][h], torch.full(SPEC.ssm_shape, float(h)))

    # A load may take such a slot at once: it is queued after the write-back on the same stream.
    for h in (0, 1):
        host.snapshots.write_back([h], [h])
    seq = host.snapshots.write_back([2], [3])
    device.free(2)
    assert device.alloc() is None and device.alloc(behind_copies=True) == 2
    loaded = host.snapshots.load([1], [2])
    assert loaded == seq + 1
    assert torch.equal(device.ssm[1][2], torch.ones(SPEC.ssm_shape))
    assert torch.equal(host.snapshots.ssm[1][3], torch.full(SPEC.ssm_shape, 2.0))
    # A slot a load still fills is not handed out either, when its snapshot goes at once.
    device.free(2)
    assert device.alloc() is None
    copier.wait(loaded)
    assert device.alloc() == 2
    for slot in (0, 1, 2):
        device.free(slot)
    assert sorted(device.free_slot_list()) == [0, 1, 2] and device.free_slots == 3


def test_snapshot_copies_travel_in_the_copy_log_with_their_numbers_and_replay_under_them(monkeypatch):
    (first, first_host), (other, other_host) = tier(fill=0.0), tier(fill=10.0)
    log = CopyLog()
    first_host.copier.log = first.log = log
    first_host.copier.write_back(torch.arange(8, 12), first_host.pool.alloc(4))
    first_host.snapshots.write_back([1], [2])
    first_host.copier.load(torch.arange(4, 8), torch.arange(20, 24))
    first_host.snapshots.load([2], [0])
    monkeypatch.setattr(state_snapshots, "STAGED_WRITE_BACKS", 0)
    first_host.snapshots.write_back([0], [3])  # not staged: the other rank reads its slot on the copy stream too
    orders = log.take()
    assert [(o.kind, o.seq, o.payload) for o in orders] == [
        (CopyKind.KV_WRITE_BACK, 1, None), (CopyKind.STATE_WRITE_BACK, 2, True), (CopyKind.KV_LOAD, 3, None),
        (CopyKind.STATE_LOAD, 4, None), (CopyKind.STATE_WRITE_BACK, 5, False)]
    replay(orders, other_host.copier, other)
    assert other_host.copier.issued_seq == 5
    assert [e[4] for e in other_host.copier._pending] == [False, False, True, True, True], \
        "the compute stream must wait for a rank's snapshot loads and unstaged write-backs"
    other_host.copier.compute_waits_for(5)
    assert not other_host.copier._pending
    for layer in range(SPEC.num_layers):  # each rank moved its own share between rank 0's slots
        assert torch.equal(other.ssm[layer][0], torch.full(SPEC.ssm_shape, 11.0))
        assert torch.equal(first.ssm[layer][0], torch.full(SPEC.ssm_shape, 1.0))
        assert torch.equal(other_host.snapshots.ssm[layer][3], torch.full(SPEC.ssm_shape, 11.0))
    with pytest.raises(RuntimeError, match="diverged"):
        other.replay(orders[1])


@pytest.mark.parametrize("evicted", ["with its KV", "for room"])
def test_a_request_resuming_from_a_host_snapshot_waits_until_its_copy_is_seen_done(qwen3_5, evicted):  # noqa: F811
    """Turn 1 ends and its snapshot goes to the host: with its KV (the device evicts everything),
    or alone (two device snapshot slots, pushed out by two later conversations, its KV on the
    device). Every copy is seen done only at the third poll asking about it: turn 2 waits in
    admission for its snapshot's load, the load numbered right after its KV load (when there is
    one), resumes only once the copy is seen done, after all turn 1 computed, with transformers'
    tokens."""
    path, prompts, _ = qwen3_5
    turn1 = prompts[3]
    with_kv = evicted == "with its KV"
    settings = dict(max_total_tokens=4096, hicache_ratio=1, chunked_prefill_size=16)
    if not with_kv:
        settings["mamba_cache_size"] = 2
    with Engine(str(path), **settings) as engine:
        cache = engine.core.cache
        copier = cache.copier
        new = 8 if with_kv else 40
        first = engine.generate(input_ids=[turn1], sampling_params={**GREEDY, "max_new_tokens": new})[0]
        computed = len(turn1) + len(first["output_ids"]) - 1
        if with_kv:
            cache.evict(cache.memory.evictable)
        else:
            engine.generate(input_ids=prompts[:2], sampling_params={**GREEDY, "max_new_tokens": 40})
            assert cache.snapshot_stats()["snapshots_written_back"] > 0
        SlowCopies(copier)
        waits, resumed = [], []
        host_states, states = cache.states.host, cache.states
        fetch, resume = host_states.fetch, states.resume

        def watched_fetch(node):
            waits.append(fetch(node))
            return waits[-1]

        def watched_resume(row, match, **kw):
            node = match.last_node
            if match.length and node.state.from_host:
                resumed.append((node.state.loading_seq, copier.done_seq, node.host.loading_seq if node.host else 0))
            return resume(row, match, **kw)

        host_states.fetch, states.resume = watched_fetch, watched_resume
        turn2 = turn1 + first["output_ids"] + [11, 12, 13, 14, 15, 16, 17]
        second = engine.generate(input_ids=[turn2], sampling_params=GREEDY)[0]
        stats = engine.cache_stats()
        check_idle(engine)
    assert waits.count(True) >= 2, "the request did not wait for its snapshot's copy"
    assert len(resumed) == 1
    load_seq, done_seq, kv_load_seq = resumed[0]
    assert 0 < load_seq <= done_seq, "resumed from a snapshot whose copy was not seen done"
    if with_kv:
        assert load_seq == kv_load_seq + 1, "the snapshot's load is not numbered right after its KV load"
    else:
        assert stats["evicted_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == computed
    assert stats["host_snapshot_hits"] == 1 and stats["host_cached_prompt_tokens"] == computed
    assert second["output_ids"] == hf_greedy(path, [turn2])[0]
