"""Where a hybrid model's prefix cache keeps recurrent-state snapshots, which go first, and how the
memory is split between running rows, snapshots and KV.

The real scheduler, radix tree and snapshot cache run with no model (a state of one float per row,
as in the scheduler simulator): what is asserted is what each admission finds usable. The
simulator then runs a small agent workload through the same parts and holds the hybrid's hit rate
against an attention-only model's with the same KV pool, for an agent that renders its history
anew and for a chat client that sends the replies back as generated.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from radixserve.bench.scheduler_sim import HYBRID_27B, SimConfig, agent_sessions, make_sessions, simulate
from radixserve.cache.factory import tree_cache
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.cache.radix_cache import PROMPT_END_SLACK
from radixserve.cache.snapshot_policy import PROMPT_END_WINDOW, SEQUENCE_END_MIN_SHARE, SEQUENCE_END_PROBE, SEQUENCE_END_WINDOW
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.cache.state_snapshots import StateSnapshots
from radixserve.cache.factory import SNAPSHOT_SPAN_TOKENS, snapshot_split
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.request import Req
from radixserve.scheduler.scheduler import Scheduler
from radixserve.settings import ServerSettings

SPEC = RecurrentStateSpec(1, (1, 1), (1, 1, 1), torch.float32)
ROWS = 8


class Harness:
    """A scheduler over a snapshot cache of `slots` snapshots, driven step by step."""

    def __init__(self, slots: int, pool: int = 4096, *, agent: bool = False, rows: int = ROWS, chunk: int = 8192):
        state = RecurrentStatePool(rows, SPEC, "cpu")
        snapshots = StateSnapshots(slots, state)
        self.cache = tree_cache(KVPool(pool, 1, 1, 1, 1, torch.float32, "cpu", state=state, snapshots=snapshots))
        if agent:  # as after an agent's windows: next turns resume at prompt ends, nobody at sequence ends
            self.cache.states._end_outcomes.extend([False] * SEQUENCE_END_WINDOW)
            self.cache.states._prompt_end_outcomes.extend([True] * PROMPT_END_WINDOW)
        table = ReqToTokenPool(rows, 1, "cpu")
        table.write = lambda *a: None  # no model reads the slot table
        settings = ServerSettings(max_total_tokens=pool, device="cpu", prefix_hold_s=0.0, chunked_prefill_size=chunk)
        self.sched = Scheduler(settings, self.cache, table, context_len=8192, eos_token_ids=[])
        self.rng = random.Random(0)
        self.count = 0

    def add(self, prompt: list[int], output: int = 4, hints: tuple[int, ...] = ()) -> Req:
        self.count += 1
        req = Req(rid=str(self.count), origin_input_ids=list(prompt), arrival_time=0.0, arrival_seq=-1,
                  sampling_params=SamplingParams(max_new_tokens=output, ignore_eos=True), branch_hints=hints)
        self.sched.add_request(req)
        return req

    def step(self) -> None:
        batch = self.sched.schedule()
        self.sched.process_results(batch, [self.rng.randrange(1000, 2000) for s in batch.sample if s])

    def run(self, *prompts: list[int], output: int = 4, hints: tuple[int, ...] = ()) -> list[Req]:
        """Serve prompts together, each generating `output` random tokens, to their end."""
        reqs = [self.add(prompt, output, hints) for prompt in prompts]
        while any(r.finish_reason is None for r in reqs):
            self.step()
        self.sched.check_invariants()
        return reqs


def ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_a_next_turn_resumes_a_few_tokens_before_the_previous_prompts_end():
    """A client sending text re-tokenizes the previous prompt's last token with the reply after it,
    and an agent's history carries its own rendering of the reply, not the sampled tokens: the
    next turn's KV match ends a token before the previous prompt's end, and the state there is the
    one kept PROMPT_END_SLACK tokens before that end."""
    h = Harness(slots=16)
    first = ids(300, 0)
    (turn1,) = h.run(first)
    assert turn1.cached_tokens == 0
    second = first[:-1] + [9999] + ids(50, 5000)  # the re-tokenized end, then the reply and a question
    (turn2,) = h.run(second)
    assert turn2.cached_tokens == len(first) - PROMPT_END_SLACK
    third = second[:-1] + [9998] + ids(50, 6000)
    (turn3,) = h.run(third)
    assert turn3.cached_tokens == len(second) - PROMPT_END_SLACK


def test_requests_branching_off_a_shared_prompt_resume_at_the_branch_point():
    """The first request leaves checkpoints on its way (128 is the deepest below 200); the second
    resumes there, finds KV past it and keeps the state where it branches off; the third resumes there."""
    h = Harness(slots=16)
    system = ids(200, 0)
    h.run(system + ids(40, 1000))
    (second,) = h.run(system + ids(40, 2000))
    assert second.cached_tokens == 128
    (third,) = h.run(system + ids(40, 3000))
    assert third.cached_tokens == len(system)


@pytest.mark.parametrize("shared", [48, 63, 100, 300, 1000, 3000])
def test_the_second_request_on_a_new_shared_prefix_finds_at_least_half_of_it(shared):
    """Two requests in a row share a prefix nobody computed before: the first cannot know where the
    second will branch, so it keeps states at checkpoints 32, 64, 128, ... tokens past where it
    resumed (captured inside its prompt pieces: no piece ends there). The deepest one inside the
    shared prefix is more than half of it."""
    h = Harness(slots=16)
    prefix = ids(shared, 0)
    (first,) = h.run(prefix + ids(40, 10000))
    (second,) = h.run(prefix + ids(40, 20000))
    assert first.cached_tokens == 0 and shared / 2 <= second.cached_tokens <= shared
    (third,) = h.run(prefix + ids(40, 30000))
    assert third.cached_tokens == shared  # the second kept the state where it branched off


def test_checkpoints_are_captured_inside_prompt_pieces():
    """A checkpoint inside a piece is written by the forward pass into a snapshot slot (the batch's
    state_captures: batch row, offset into the piece, slot); it adds no piece, so the prompt is
    computed in as many steps as without it."""
    h = Harness(slots=16)
    prompt = ids(300, 0)
    req = h.add(prompt)
    batch = h.sched.schedule()
    assert batch.extend_lens == [len(prompt) - PROMPT_END_SLACK]  # the prompt-end piece, as before
    assert [(row, offset) for row, offset, _ in batch.state_captures] == [(0, 32), (0, 64), (0, 128), (0, 256)]
    h.sched.process_results(batch, [])
    while req.finish_reason is None:
        h.step()
    assert h.cache.peek(prompt[:100])[0] == 64


def test_a_system_turn_marked_by_the_chat_api_is_where_the_second_request_resumes():
    """The chat API marks where a conversation's system turn ends (Req.branch_hints): the first
    request keeps the state exactly there, and the next conversation on that system prompt resumes
    there, its whole system prompt cached."""
    h = Harness(slots=16)
    system = ids(700, 0)
    (first,) = h.run(system + ids(40, 10000), hints=(len(system),))
    (second,) = h.run(system + ids(40, 20000), hints=(len(system),))
    assert (first.cached_tokens, second.cached_tokens) == (0, len(system))


def next_turn(prompt: list[int], start: int) -> list[int]:
    """The next turn of an agent's conversation: its history rendered anew (the prompt's last token
    re-tokenized with the reply, the reply as the agent keeps it), then a question."""
    return prompt[:-1] + [start] + ids(40, start + 1)


def test_a_burst_on_a_new_shared_prompt_keeps_the_state_where_its_requests_branch():
    """Prompts sharing a system prompt nobody computed yet arrive together: the first admitted ends
    a prompt piece where a waiting one branches off it (the others wait for it, in-batch), so every
    other resumes after the system prompt, none computes it again."""
    h = Harness(slots=16)
    system = ids(300, 0)
    reqs = h.run(*(system + ids(40, 1000 * (i + 1)) for i in range(4)))
    assert sorted(r.cached_tokens for r in reqs) == [0] + [len(system)] * 3


def test_checkpoints_never_take_a_slot_from_a_snapshot_kept_for_a_later_turn():
    """Checkpoints are the cheapest guesses: taken into free slots, or in place of a checkpoint
    worth less (fewer tokens saved, with recency), never in place of a snapshot kept for a turn to
    come or a branch seen. Three conversations' snapshots and a long new prompt in four slots: its
    checkpoints take only the one slot a checkpoint held, and its prompt's end takes that one."""
    h = Harness(slots=4, agent=True)
    firsts = [h.run(ids(100, 1000 * c), output=1)[0] for c in range(3)]
    h.run(ids(3000, 50000), output=1)
    for c, first in enumerate(firsts):
        assert h.cache.peek(next_turn(first.origin_input_ids, 5000 + 100 * c)[:-1])[0] == 100 - PROMPT_END_SLACK


def test_the_hybrid_reaches_the_unlimited_hit_rate_on_shared_prompts():
    """gsp-shaped traffic (single-turn prompts on 32 system prompts, all at once, a pool that holds
    everything): the hybrid finds each system prompt computed once, as an attention-only model."""
    cfg = SimConfig(**{**HYBRID_27B, "sessions": 256, "turns": 1, "systems": 32, "system_len": 1024,
                       "user_len": 128, "output_len": 16, "pool": 1_000_000, "snapshots": 400, "max_running": 32})
    sessions = agent_sessions(cfg)
    hybrid = simulate(cfg, sessions)
    attention = simulate(dataclasses.replace(cfg, snapshots=0), sessions)
    assert hybrid["hit_rate"] >= attention["hit_rate"] - 0.002, (hybrid, attention)


def test_a_turns_snapshot_outlives_the_earlier_one_its_request_resumed_from():
    """The snapshot a turn resumed from is touched by that resume, but once the turn keeps a deeper
    one on the same path it resumes nobody the deeper one would not: it goes before another
    conversation's older snapshot."""
    h = Harness(slots=3, agent=True)
    a1, b1 = ids(100, 0), ids(100, 20000)
    h.run(a1, output=1)
    h.run(b1, output=1)
    (a2,) = h.run(next_turn(a1, 5000), output=1)  # resumes at a1's snapshot, keeps one near its end
    assert a2.cached_tokens == len(a1) - PROMPT_END_SLACK
    h.run(ids(100, 40000), output=1)  # a third conversation needs a slot: a1's goes, b1's stays
    (b2,) = h.run(next_turn(b1, 6000), output=1)
    assert b2.cached_tokens == len(b1) - PROMPT_END_SLACK


def test_a_snapshot_a_waiting_request_will_resume_from_is_not_given_up_for_a_new_one():
    """One snapshot slot, one request row: a conversation's next turn waits for the row, parked on
    its previous prompt's snapshot, while another request reaches its own prompt's end. That
    request keeps nothing (its snapshot only may be used); the waiting turn resumes."""
    h = Harness(slots=1, agent=True, rows=1, chunk=64)
    a1 = ids(100, 0)
    h.run(a1, output=1)
    other = h.add(ids(300, 20000), output=2)
    h.step()  # admitted; its prompt runs in pieces of 64
    a2 = h.add(next_turn(a1, 5000), output=1)
    while a2.finish_reason is None:
        h.step()
    assert a2.cached_tokens == len(a1) - PROMPT_END_SLACK
    assert other.finish_reason is not None


def test_a_full_pool_takes_the_snapshot_on_a_running_requests_path():
    """A snapshot on a path a running request holds was copied into that request's row when it was
    admitted or is its own, not needed before it leaves: a full pool may evict it for another
    request's (a pool smaller than the running batch would otherwise keep nothing new)."""
    h = Harness(slots=1, agent=True)
    a = h.add(ids(100, 0), output=40)
    while not a.output_ids:
        h.step()
    assert h.cache.states.snapshots_held == 1  # a's prompt end, on its locked path while it decodes
    (b,) = h.run(ids(100, 20000), output=1)
    assert a.finish_reason is None
    while a.finish_reason is None:
        h.step()
    (b2,) = h.run(next_turn(b.origin_input_ids, 7000), output=1)
    assert b2.cached_tokens == 100 - PROMPT_END_SLACK


def test_a_retracted_request_keeps_the_state_where_it_stopped_even_when_sequence_ends_do_not_pay():
    """An agent's sequence-end snapshots go untaken (nobody resumes from them), but a request
    retracted for memory will resume where it stopped: it keeps that state instead of computing
    everything it generated again."""
    h = Harness(slots=8, pool=320, agent=True)
    a, b = h.add(ids(100, 0), output=80), h.add(ids(100, 5000), output=80)
    computed = 0
    while not b.num_retractions:
        computed = b.kv_len
        h.step()
    assert computed > 100 and a.finish_reason is None
    assert h.cache.waiting.peek_park(b.match_target())[0] == computed == len(b.match_target())
    while b.finish_reason is None or a.finish_reason is None:
        h.step()
    h.sched.check_invariants()


def _leave_sequence_ends(h: Harness, conversations: int, *, echo: bool) -> int:
    """Run `conversations` two-turn conversations one after another; the second turn sends the
    reply back as generated (echo) or as the agent renders it. Returns the snapshots taken other
    than checkpoints (prompt ends and sequence ends: a new prompt's ladder rung may take a slot from
    an older guess, which says nothing of the sequence ends)."""
    counters = h.cache.states.counters
    before = counters.taken - counters.checkpoints_taken
    for c in range(conversations):
        prompt = ids(60, 100 * c + 100000)
        (first,) = h.run(prompt, output=12)
        history = prompt + first.output_ids if echo else prompt[:-1] + [9999] + ids(12, 9000)
        h.run(history + ids(30, 200000 + 100 * c), output=1)
    return counters.taken - counters.checkpoints_taken - before


def test_sequence_end_snapshots_are_kept_while_the_next_turns_resume_from_them():
    """A request that kept a snapshot near its prompt's end takes another where its sequence ends
    while such snapshots are resumed from; once a window of them went unused it takes one in
    SEQUENCE_END_PROBE, and takes them again when the replies come back as generated."""
    h = Harness(slots=8)
    # The window fills with sequence-end snapshots nobody resumed from (an agent's history).
    _leave_sequence_ends(h, SEQUENCE_END_WINDOW + 4, echo=False)
    assert sum(h.cache.states._end_outcomes) < SEQUENCE_END_MIN_SHARE * SEQUENCE_END_WINDOW
    # Each turn now keeps its prompt's end; one leaving request in SEQUENCE_END_PROBE its sequence end.
    taken = _leave_sequence_ends(h, 2 * SEQUENCE_END_PROBE, echo=False)
    assert taken <= 2 * (2 * SEQUENCE_END_PROBE) + 2 * 2
    # Replies sent back as generated resume from the probes' snapshots, and the share recovers.
    resumed = []
    for c in range(4 * SEQUENCE_END_WINDOW):
        prompt = ids(60, 400000 + 100 * c)
        (turn,) = h.run(prompt, output=12)
        (follow,) = h.run(prompt + turn.output_ids + ids(30, 600000 + 100 * c), output=1)
        resumed.append(follow.cached_tokens == len(prompt) + len(turn.output_ids) - 1)
    assert sum(h.cache.states._end_outcomes) >= SEQUENCE_END_MIN_SHARE * SEQUENCE_END_WINDOW
    assert all(resumed[-SEQUENCE_END_WINDOW:])  # once the probes paid, every one is kept


@pytest.mark.parametrize("echo", [False, True], ids=["agent-history", "replies-sent-back"])
def test_the_hybrid_keeps_what_an_attention_model_keeps_on_the_agent_workload(echo):
    """The scheduler simulator on a small agent workload (96 sessions x 4 turns) under cache
    pressure, with the 27B hybrid's step costs: the snapshot cache keeps at least 0.95 of the
    prompt-token hit rate of an attention-only model with the same KV pool and running rows."""
    cfg = SimConfig(**{**HYBRID_27B, "sessions": 96, "turns": 4, "pool": 80000, "max_running": 24,
                       "snapshots": 80, "echo_replies": echo})
    sessions = agent_sessions(cfg)
    hybrid = simulate(cfg, sessions)
    attention = simulate(dataclasses.replace(cfg, snapshots=0), sessions)
    assert hybrid["hit_rate"] >= 0.95 * attention["hit_rate"], (hybrid, attention)
    assert hybrid["snapshot_hits"] > 0.8 * 96 * 3  # most later turns resumed from a snapshot


def test_the_hybrid_keeps_what_an_attention_model_keeps_on_chat_traffic():
    """The scheduler simulator on chat traffic through the chat API (32 system prompts each seen by
    4 requests in a row, all at once, the system turns' ends marked) under KV and snapshot pressure
    (48 snapshots, 16 rows): the hybrid keeps at least 0.95 of an attention-only model's hit rate
    with the same pool and rows."""
    cfg = SimConfig(**{**HYBRID_27B, "workload": "chat", "systems": 32, "visits": 4, "system_len": 1024,
                       "user_len": 128, "output_len": 32, "pool": 40000, "max_running": 16, "snapshots": 48})
    sessions = make_sessions(cfg)
    hybrid = simulate(cfg, sessions)
    attention = simulate(dataclasses.replace(cfg, snapshots=0), sessions)
    assert hybrid["hit_rate"] >= 0.95 * attention["hit_rate"], (hybrid, attention)
    assert hybrid["snapshot_hits"] >= 0.9 * 32 * 3  # nearly every later visit resumed after its system prompt


def test_the_memory_plan_splits_the_pool_between_kv_and_snapshots():
    settings = ServerSettings(device="cpu")
    spec = RecurrentStateSpec(1, (1, 1), (1, 1, 38_475_000), torch.float32)  # ~147 MiB, as Qwen3.5-27B's
    per_token, snapshot, cuda = 65536, spec.bytes_per_row, torch.device("cuda")
    budget = 800_000  # what the memory plan left for the pool, in KV tokens
    slots, tokens = snapshot_split(settings, spec, cuda, budget, per_token, planned=True)
    assert slots == budget * per_token // (snapshot + SNAPSHOT_SPAN_TOKENS * per_token)
    assert slots * snapshot + tokens * per_token <= budget * per_token
    assert tokens // SNAPSHOT_SPAN_TOKENS == slots  # one snapshot per span of the pool
    # --max-total-tokens: the pool is as given, the snapshots beside it.
    assert snapshot_split(settings, spec, cuda, 216_825, per_token, planned=False) == (211, 216_825)
    # ... in what the memory fraction leaves beside it: fewer when they do not fit (an H100 with the
    # 27B's weights and that pool has room for 48, not 211), an error for an explicit count.
    room = 48 * snapshot + snapshot // 2
    assert snapshot_split(settings, spec, cuda, 216_825, per_token, planned=False, room_bytes=room) == (48, 216_825)
    assert snapshot_split(settings, spec, cuda, 216_825, per_token, planned=False, room_bytes=-1) == (0, 216_825)
    with pytest.raises(ValueError, match="--mamba-cache-size 100 snapshots .* at most 48 snapshots"):
        snapshot_split(dataclasses.replace(settings, mamba_cache_size=100), spec, cuda, 216_825, per_token,
                       planned=False, room_bytes=room)
    # --mamba-cache-size comes out of the planned budget; too many is a clear error.
    explicit = dataclasses.replace(settings, mamba_cache_size=100)
    assert snapshot_split(explicit, spec, cuda, budget, per_token, planned=True) == \
        (100, budget - -(-100 * snapshot // per_token))
    with pytest.raises(ValueError, match="--mamba-cache-size 400 snapshots"):
        snapshot_split(dataclasses.replace(settings, mamba_cache_size=400), spec, cuda, budget, per_token,
                       planned=True)
    # No prefix cache, no snapshots; the CPU keeps its fixed count.
    off = dataclasses.replace(settings, disable_radix_cache=True)
    assert snapshot_split(off, spec, cuda, budget, per_token, planned=True) == (0, budget)
    assert snapshot_split(settings, spec, torch.device("cpu"), 65536, per_token, planned=False) == (64, 65536)


def test_checkpoints_that_save_more_get_the_slots_and_fresh_ones_replace_stale_ones():
    """Five slots, a new 2,100-token prompt: its prompt's and its sequence's ends are kept, and of
    its checkpoints (32 ... 2,048 tokens in) the three that save most (2,048, 1,024, 512: each saves
    the tokens since the one below) take the other slots. A second such prompt later keeps its own
    in their place: a checkpoint's worth halves with every turnover of the pool. (Both windows
    proven: a prompt's and a sequence's ends are kept, not guesses.)"""
    h = Harness(slots=5)
    h.cache.states._prompt_end_outcomes.extend([True] * PROMPT_END_WINDOW)
    h.cache.states._end_outcomes.extend([True] * SEQUENCE_END_WINDOW)
    a, b = ids(2100, 0), ids(2100, 10000)
    h.run(a, output=1)
    assert [h.cache.peek(a[:n])[0] for n in (300, 600, 1100, 2060)] == [0, 512, 1024, 2048]
    h.run(b, output=1)
    assert [h.cache.peek(b[:n])[0] for n in (1100, 2060)] == [1024, 2048]
    assert h.cache.peek(a[:2060])[0] < 2048  # a checkpoint ages by a tick per new prompt, not per checkpoint


def test_a_burst_of_new_prompts_keeps_their_checkpoints_for_the_second_users():
    """Unmarked chat traffic: four new 300-token system prompts, each with its first user, all at
    once, and eight snapshot slots. The second users should find the checkpoint at 256 tokens and
    the third users the whole system prompt: the first users' prompt ends and sequence ends are
    guesses while their windows are empty (kept, they took all eight slots and the second users
    found nothing)."""
    h = Harness(slots=8, rows=4)
    systems = [ids(300, 100000 * s) for s in range(4)]
    firsts = h.run(*[system + ids(40, 100000 * s + 50000) for s, system in enumerate(systems)])
    assert [r.cached_tokens for r in firsts] == [0] * 4
    seconds = h.run(*[system + ids(40, 100000 * s + 60000) for s, system in enumerate(systems)])
    assert [r.cached_tokens for r in seconds] == [256] * 4
    thirds = h.run(*[system + ids(40, 100000 * s + 70000) for s, system in enumerate(systems)])
    assert [r.cached_tokens for r in thirds] == [300] * 4
