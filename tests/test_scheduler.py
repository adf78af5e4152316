"""Scheduling decisions: LPM ordering at scale and against FCFS, its starvation bound, admission's
memory arithmetic and the choice of the request to retract."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.engine.messages import GenerateRequest
from radixserve.sampling_params import SamplingParams
from radixserve.testing.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-sched"))


# The tests' arrival times count from here: an hour ahead of the engine's clock, so no request is
# overdue for LPM's wait bound unless a test moves the waiting queue's clock.
CLOCK_BASE = time.monotonic() + 3600.0


def request(rid: str, ids: list[int], t: float, max_new: int = 1) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=ids, arrival_time=CLOCK_BASE + t,
                           sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True))


def test_scheduling_cost_does_not_grow_with_queue_times_prompt(tiny_dir):
    engine = Engine(str(tiny_dir), max_total_tokens=60000, max_running_requests=64, max_prefill_tokens=2048,
                    chunked_prefill_size=2048)
    core, sched = engine.core, engine.core.scheduler
    rng = random.Random(0)
    systems = [[rng.randrange(3, 500) for _ in range(200)] for _ in range(16)]
    for i in range(3000):
        core.add_request(request(f"r{i}", systems[i % 16] + [rng.randrange(3, 500) for _ in range(40)], 0.0,
                                 max_new=2))
    sched_times = []
    for _ in range(12):
        start = time.perf_counter()
        batch = sched.schedule()
        sched_times.append(time.perf_counter() - start)
        if batch is not None:
            sched.process_results(batch, core.runner.forward(batch))
    # Lookups are redone only for requests parked at touched nodes, not for the whole queue each step.
    assert sched.waiting.repeeks < 3000 * 3
    assert sorted(sched_times)[len(sched_times) // 2] < 0.25, sched_times
    for rid in list(sched.reqs):
        core.abort(rid)
    engine.check_invariants()


@pytest.mark.parametrize("max_wait_s,bounded", [(1.0, True), (1e9, False)])
def test_lpm_wait_bound_ends_starvation(tiny_dir, max_wait_s, bounded):
    """A request that matches nothing is served once it has waited lpm_max_wait_s, however many
    requests with a long cached prefix keep arriving; without the bound pure LPM starves it."""
    engine = Engine(str(tiny_dir), max_total_tokens=8000, max_running_requests=1, context_length=512,
                    lpm_max_wait_s=max_wait_s)
    core = engine.core
    now = [0.0]
    core.scheduler.waiting.clock = lambda: CLOCK_BASE + now[0]
    rng = random.Random(3)
    system = [rng.randrange(3, 500) for _ in range(300)]
    engine.generate(input_ids=system + [5], sampling_params={"max_new_tokens": 1, "temperature": 0})
    core.add_request(request("lonely", [rng.randrange(3, 500) for _ in range(30)], now[0]))
    order: list[str] = []
    served_after = None
    for i in range(40):  # a matching request arrives every 0.1 s, one request is served per step
        now[0] += 0.1
        core.add_request(request(f"m{i}", system + [rng.randrange(3, 500)], now[0]))
        order += [out.rid for out in core.step() if out.finished]
        if "lonely" in order and served_after is None:
            served_after = now[0]
    order += run_until_idle(core)
    if bounded:
        assert served_after is not None and served_after <= max_wait_s + 0.25, served_after
        assert 5 <= order.index("lonely") < 15  # LPM first, then the bound
    else:
        assert order[-1] == "lonely"  # without the bound, pure LPM starves it to the end
    engine.check_invariants()


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def run_until_idle(core) -> list[str]:
    """Step until nothing is left; the request ids in the order they finished."""
    finished = []
    while core.has_work:
        finished += [out.rid for out in core.step() if out.finished]
    return finished


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_lpm_serves_cached_prefixes_first_and_hits_more_than_fcfs(tiny_dir, policy):
    """A pool that holds one 60-token prompt: a cached system prompt, then unrelated prompts and
    prompts extending the system prompt, alternating. LPM serves the three extensions while the
    system prompt is cached (60 hits each); FCFS lets each unrelated prompt evict it first."""
    engine = Engine(str(tiny_dir), max_total_tokens=80, max_running_requests=1, schedule_policy=policy)
    core = engine.core
    rng = random.Random(7)
    system = ids(rng, 60)
    core.add_request(request("system", system, 0.0))
    run_until_idle(core)
    for i in range(3):
        core.add_request(request(f"u{i}", ids(rng, 60), 1.0))
        core.add_request(request(f"q{i}", system + ids(rng, 4), 1.0))
    order = run_until_idle(core)
    stats = engine.cache_stats()
    if policy == "lpm":
        assert order == ["q0", "q1", "q2", "u0", "u1", "u2"]
        assert stats["cached_prompt_tokens"] == 3 * 60
    else:
        assert order == ["u0", "q0", "u1", "q1", "u2", "q2"]
        assert stats["cached_prompt_tokens"] == 0
    assert stats["prompt_tokens"] == 60 + 3 * 60 + 3 * 64
    engine.check_invariants()


@pytest.mark.parametrize("overlap", [True, False])
def test_admission_counts_the_cached_prefix_it_locks(tiny_dir, overlap):
    """Locking a request's cached prefix takes those tokens out of what can be evicted: admission
    must count them. Here the waiting request's new tokens and decode reservation (59) fit in
    free + evictable less the running request's reservation (109), but not once its 60 cached
    tokens are locked (49): it waits until the running request finishes."""
    engine = Engine(str(tiny_dir), max_total_tokens=200, disable_overlap_schedule=not overlap)
    core, sched = engine.core, engine.core.scheduler
    rng = random.Random(11)
    system = ids(rng, 60)
    core.add_request(request("system", system, 0.0))
    run_until_idle(core)
    core.add_request(request("running", ids(rng, 20), 1.0, max_new=100))
    core.step()  # its prompt
    assert [r.rid for r in sched.running] == ["running"]
    core.add_request(request("waiting", system + ids(rng, 10), 2.0, max_new=70))
    waiting = sched.reqs["waiting"]
    core.step()
    assert [r.rid for r in sched.running] == ["running"] and waiting.state.value == "waiting"
    assert waiting.req_pool_idx is None and waiting.locked_len == 0  # un-admitted: holds nothing
    assert run_until_idle(core) == ["running", "waiting"]
    assert waiting.cached_tokens == 60
    engine.check_invariants()


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_takes_the_request_with_the_least_output(tiny_dir, overlap):
    """Two requests decode until the pool is full: the one that has produced less output (the
    later one) is retracted, every time, and both still produce the tokens of a roomy run."""
    prompts = {"early": list(range(10, 20)), "late": list(range(30, 40))}
    roomy = Engine(str(tiny_dir), max_total_tokens=4096)
    expected = {rid: roomy.generate(input_ids=p, sampling_params={"max_new_tokens": 40, "temperature": 0,
                                                                   "ignore_eos": True})["output_ids"]
                for rid, p in prompts.items()}
    engine = Engine(str(tiny_dir), max_total_tokens=64, schedule_conservativeness=0.0,
                    disable_overlap_schedule=not overlap)
    core, sched = engine.core, engine.core.scheduler
    outputs = {rid: [] for rid in prompts}
    core.add_request(request("early", prompts["early"], 0.0, max_new=40))
    reqs = {"early": sched.reqs["early"]}
    for _ in range(12):
        for out in core.step():
            outputs[out.rid] += out.new_token_ids
    core.add_request(request("late", prompts["late"], 1.0, max_new=40))
    reqs["late"] = sched.reqs["late"]
    while core.has_work:
        for out in core.step():
            outputs[out.rid] += out.new_token_ids
    assert reqs["early"].num_retractions == 0
    assert reqs["late"].num_retractions >= 1
    assert engine.cache_stats()["retractions"] == reqs["late"].num_retractions
    assert outputs == expected
    engine.check_invariants()

