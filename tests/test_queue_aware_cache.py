"""Queue-aware eviction and admission, LPM's wait bound and the prefix hold.

The radix cache counts, for every node, the waiting requests whose cached match runs through it;
those prefixes are evicted last and are no room for new requests while the pool is busy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.bench.scheduler_sim import SimConfig, agent_sessions, simulate
from radixserve.cache.kv_pool import PageAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import PROMPT_END_SLACK, RadixCache
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.request import Req
from radixserve.scheduler.scheduler import CONVERSATION_WINDOW, Scheduler
from radixserve.settings import ServerSettings


def _insert(cache: RadixCache, tokens: list[int]) -> None:
    slots = cache.allocator.alloc_pages(len(tokens))
    assert slots is not None
    cache.insert(tokens, torch.tensor(slots, dtype=torch.int64))


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_waited_prefix_is_evicted_last(policy):
    cache = RadixCache(PageAllocator(64, 1), eviction_policy=policy)
    old, new = [1] * 10, [2] * 10
    _insert(cache, old)  # older, and evicted first by every policy without waiters
    _insert(cache, new)
    _, old_node = cache.peek(old)
    cache.waiting.add_waiter(old_node)
    assert cache.memory.waited == 10 and cache.memory.reclaimable == 10
    assert cache.evict(10) == 10
    assert cache.peek(old)[0] == 10 and cache.peek(new)[0] == 0
    cache.memory.check()
    cache.evict(10)  # nothing else is left: the waited prefix goes too
    assert cache.peek(old)[0] == 0 and cache.memory.waited == 0
    cache.waiting.remove_waiter(old_node)  # the request re-parks after the eviction: counts stay consistent
    cache.memory.check()


def test_waiter_counts_follow_locks_splits_and_flush():
    cache = RadixCache(PageAllocator(64, 1))
    _insert(cache, list(range(20)))
    _, node = cache.peek(list(range(20)))
    cache.waiting.add_waiter(node)
    assert cache.memory.waited == 20
    match = cache.match(list(range(8)) + [99])  # splits the node after 8 tokens and locks nothing yet
    cache.lock(match.last_node)
    assert cache.memory.waited == 12  # the locked upper part is protected, not evictable
    cache.memory.check()
    cache.unlock(match.last_node)
    assert cache.memory.waited == 20
    assert cache.flush()
    assert cache.memory.waited == 0
    cache.waiting.remove_waiter(node)  # a request parked before the flush leaves the old path
    cache.memory.check()


def _scheduler(pool: int, clock, **overrides) -> Scheduler:
    settings = ServerSettings(max_total_tokens=pool, device="cpu", **overrides)
    cache = RadixCache(PageAllocator(pool, 1))
    return Scheduler(settings, cache, ReqToTokenPool(16, 1024, "cpu"), context_len=1024, eos_token_ids=[],
                     clock=clock)


def _req(rid: str, ids: list[int], t: float, max_new: int = 4) -> Req:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return Req(rid=rid, origin_input_ids=ids, sampling_params=params, arrival_time=t, arrival_seq=-1)


def _run_to_end(sched: Scheduler) -> list[str]:
    finished = []
    while sched.has_work:
        batch = sched.schedule()
        assert batch is not None
        for req in sched.process_results(batch, [7] * sum(batch.sample)):
            if req.finish_reason is not None:
                finished.append(req.rid)
    return finished


def test_lpm_wait_bound_puts_the_overdue_first():
    now = [0.0]
    sched = _scheduler(4096, lambda: now[0], lpm_max_wait_s=4.0)
    system = list(range(100, 300))
    sched.add_request(_req("warm", system + [1], 0.0))
    _run_to_end(sched)
    sched.add_request(_req("cold-1", [5] * 50, 1.0))
    sched.add_request(_req("cold-2", [6] * 50, 2.0))
    sched.add_request(_req("hot", system + [2], 3.0))
    now[0] = 3.0  # nobody has waited 4 s: pure LPM
    assert [r.rid for r in sched.waiting.ordered()] == ["hot", "cold-1", "cold-2"]
    now[0] = 5.5  # cold-1 has waited 4.5 s
    assert [r.rid for r in sched.waiting.ordered()] == ["cold-1", "hot", "cold-2"]
    now[0] = 6.5  # both cold requests are overdue, hot is not: they go first
    assert [r.rid for r in sched.waiting.ordered()] == ["cold-1", "cold-2", "hot"]
    # All overdue (a burst that outlasts the bound): LPM again among them, within arrival
    # windows of 4 s, so the order does not collapse into FCFS.
    sched.add_request(_req("hot-late", system + [3], 5.5))  # a window after cold-1's
    now[0] = 10.0
    assert [r.rid for r in sched.waiting.ordered()] == ["hot", "cold-1", "cold-2", "hot-late"]
    assert _run_to_end(sched) == ["hot", "cold-1", "cold-2", "hot-late"]
    sched.check_invariants()


def test_waiting_prefix_is_no_room_for_a_new_request_while_busy():
    now = [0.0]
    sched = _scheduler(600, lambda: now[0])
    hot = list(range(1000, 1200))
    sched.add_request(_req("first", hot + [1], 0.0, max_new=2))
    _run_to_end(sched)  # hot's 200 tokens are cached and unlocked
    # A long runner fills the pool past half, then one request waits on hot's prefix.
    sched.add_request(_req("runner", list(range(2000, 2300)), 1.0, max_new=40))
    batch = sched.schedule()
    sched.process_results(batch, [7])
    sched.add_request(_req("hot-again", hot + [2], 2.0, max_new=2))
    sched.add_request(_req("cold", list(range(3000, 3090)), 2.0, max_new=2))
    assert sched.cache.memory.waited >= 200
    sched.waiting.remove(sched.reqs["hot-again"])  # as if it had not arrived yet: cold may use the room
    room_without_waiter = sched.cache.memory.reclaimable
    sched.waiting.add(sched.reqs["hot-again"])
    assert room_without_waiter - sched.cache.memory.reclaimable >= 200
    hot_again = sched.reqs["hot-again"]
    _run_to_end(sched)
    assert sched.reqs == {} and hot_again.cached_tokens == 200  # cold did not evict it
    sched.check_invariants()


def test_fcfs_keeps_a_put_back_request_in_its_place():
    """A request taken out to be admitted and put back (it did not fit this step), or retracted,
    stays where its arrival puts it: FCFS does not send the head of the queue to the back."""
    now = [0.0]
    sched = _scheduler(1024, lambda: now[0], schedule_policy="fcfs")
    reqs = [_req(f"r{i}", list(range(10 * i, 10 * i + 10)), 0.0) for i in range(4)]
    for req in reqs:
        sched.add_request(req)
    head = reqs[0]
    sched.waiting.remove(head)
    sched.waiting.add(head)
    assert [r.rid for r in sched.waiting.ordered()] == ["r0", "r1", "r2", "r3"]
    assert [r.rid for r in sched.waiting] == ["r0", "r1", "r2", "r3"]
    sched.check_invariants()


def test_a_finished_prompt_end_is_marked_and_found_by_the_next_turn_only():
    cache = RadixCache(PageAllocator(256, 1))
    system, question = list(range(100, 120)), list(range(200, 220))
    prompt = system + question
    _insert(cache, prompt + [1, 2, 3])  # a finished request: its prompt and its output
    cache.conversations.mark_prompt_end(prompt, beyond=0)
    _, node = cache.peek(prompt)
    assert node.ends_prompt and len(cache.tree.path_tokens(node)) == len(prompt)  # split at the prompt's end
    next_turn = prompt + [9, 9] + list(range(300, 310))  # the conversation so far (another reply), more
    assert cache.conversations.extends_a_prompt(cache.match(next_turn).last_node)
    other = system + list(range(400, 420))  # another question under the same system prompt
    assert not cache.conversations.extends_a_prompt(cache.match(other).last_node)  # split inside the marked node ...
    assert cache.conversations.extends_a_prompt(cache.match(next_turn).last_node)  # ... whose lower part keeps the mark
    cache.conversations.mark_prompt_end(other, beyond=len(other))  # found whole in the cache: marks nothing
    assert not cache.conversations.extends_a_prompt(cache.match(other).last_node)
    cache.memory.check()


def test_a_next_turn_that_retokenized_the_prompts_last_token_still_continues_it():
    """A client sending text re-reads the previous prompt's last token together with the reply
    after it: the next turn's match stops a token short of the mark and still counts; a match that
    stops further short (another question under the same system prompt) does not."""
    cache = RadixCache(PageAllocator(256, 1))
    system, question = list(range(100, 120)), list(range(200, 220))
    prompt = system + question
    _insert(cache, prompt + [1, 2, 3])
    cache.conversations.mark_prompt_end(prompt, beyond=0)
    retokenized = prompt[:-1] + [219_000] + list(range(300, 310))
    match = cache.match(retokenized)
    assert match.length == len(prompt) - 1 and cache.conversations.extends_a_prompt(match.last_node)
    far_short = prompt[:-PROMPT_END_SLACK - 1] + list(range(500, 520))
    assert not cache.conversations.extends_a_prompt(cache.match(far_short).last_node)
    # The same prompt sent again (its last token left to compute) continues nothing.
    again = cache.match(prompt[:-1])
    assert not cache.conversations.extends_a_prompt(again.last_node, uncached=1)
    assert cache.conversations.extends_a_prompt(cache.match(retokenized).last_node,
                                                uncached=len(retokenized) - match.length)
    cache.memory.check()


@pytest.mark.parametrize("sent_as", ["ids", "text"])
def test_prefix_hold_keeps_a_conversation_turns_prefix_for_its_duration(sent_as):
    """A later turn is held whether its ids repeat the previous prompt exactly or, as a client
    sending text re-tokenizes it, differ in the previous prompt's last token."""
    now = [0.0]
    sched = _scheduler(1024, lambda: now[0], prefix_hold_s=1.0)
    first = list(range(400, 500))
    sched.add_request(_req("turn-1", first, 0.0, max_new=3))
    _run_to_end(sched)
    assert sched.cache.memory.waited == 0  # nothing says anyone comes back for it: not held
    second = first + [7, 7] + list(range(600, 620))  # the previous prompt, a reply, the next message
    if sent_as == "text":
        second[len(first) - 1] = 4999  # the boundary token re-read together with the reply
    sched.add_request(_req("turn-2", second, 0.0, max_new=3))
    _run_to_end(sched)
    assert sched.cache.memory.waited == len(second) + 2  # the prompt and the outputs with KV
    sched.check_invariants()
    now[0] = 0.9
    assert not sched.release_expired_holds() and sched.cache.memory.waited == len(second) + 2
    now[0] = 1.1
    assert sched.release_expired_holds() and sched.cache.memory.waited == 0
    sched.check_invariants()


def test_the_same_prompt_sent_again_is_no_later_turn():
    """A retry or a health probe repeats a finished prompt exactly: it finds all of it cached but
    the last token, and is neither counted as a conversation's turn nor held."""
    now = [0.0]
    sched = _scheduler(1024, lambda: now[0], prefix_hold_s=1.0)
    prompt = list(range(400, 500))
    for rid in ("first", "again", "once more"):
        sched.add_request(_req(rid, prompt, 0.0, max_new=1))
        _run_to_end(sched)
    assert sched.stats.continued_turns == 0 and sched.stats.prefix_holds == 0
    sched.check_invariants()


def test_mostly_conversation_traffic_holds_every_finished_prefix():
    """Once a quarter of the recent admissions continued a conversation, first turns are held too
    (the next turn of each is likely); before that, one-off requests hold nothing."""
    now = [0.0]
    sched = _scheduler(8192, lambda: now[0], prefix_hold_s=5.0)
    sessions = [list(range(1000 + 40 * i, 1020 + 40 * i)) for i in range(CONVERSATION_WINDOW // 4)]
    for i, prompt in enumerate(sessions):
        sched.add_request(_req(f"s{i}-1", prompt, 0.0, max_new=3))
    _run_to_end(sched)
    assert sched.cache.memory.waited == 0
    for i, prompt in enumerate(sessions):
        sched.add_request(_req(f"s{i}-2", prompt + [7, 7, 5000 + i], 0.0, max_new=3))
    _run_to_end(sched)
    held_turns = sched.cache.memory.waited
    assert held_turns == len(sessions) * (20 + 3 + 2)  # every second turn: its prompt and outputs with KV
    one_off = list(range(9000, 9030))
    sched.add_request(_req("one-off", one_off, 0.0, max_new=3))
    _run_to_end(sched)
    assert sched.cache.memory.waited == held_turns + len(one_off) + 2
    sched.check_invariants()


def test_agent_sessions_under_pressure_lpm_keeps_more_than_fcfs():
    """The seed's scenario, scaled down: 256 multi-turn sessions, all at once, a pool that cannot
    keep every conversation (the H200 run's sessions with half its system prompts and pool, three
    turns). Runs the real scheduler and cache (no model), deterministically. LPM's lead needs a
    long queue to choose from: with 64 sessions FCFS kept as much."""
    cfg = SimConfig(turns=3, system_len=1024, pool=108000, prefix_hold_s=0.0)
    sessions = agent_sessions(cfg)
    lpm = simulate(dataclasses.replace(cfg, policy="lpm"), sessions)
    fcfs = simulate(dataclasses.replace(cfg, policy="fcfs"), sessions)
    assert lpm["hit_rate"] >= fcfs["hit_rate"] + 0.02, (lpm, fcfs)
    assert lpm["turns_that_lost_the_previous_prompt"] < fcfs["turns_that_lost_the_previous_prompt"]
    for run in (lpm, fcfs):  # the latency figures are the client's: first token within the whole
        assert 0 < run["p99_ttft_s"] <= run["p99_latency_s"], run
        if run["retractions"] == 0:  # a stream never put back in the queue waits one step at most
            assert run["longest_pause_s"] < 0.5, run
