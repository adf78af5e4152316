"""The balanced router policy: cache saving against load as one cost, on a skewed workload (one
system-prompt group with half the traffic). In-process over the real policy and worker objects with a
scripted order of arrivals and completions, then through a real router over real CPU workers."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from radixserve.router.policies import Balanced, BalanceConfig, CacheAware, RoundRobin, RoutingKeys
from radixserve.router.prefix_tree import PrefixTree
from radixserve.router.workers import Worker


def skewed_prompts(rng: random.Random, n: int, groups: int, system_len: int, question_len: int,
                   vocab: range) -> list[list[int]]:
    """Group 0 gets half the requests, the other groups share the rest; shuffled."""
    systems = [[rng.choice(vocab) for _ in range(system_len)] for _ in range(groups)]
    out = []
    for i in range(n):
        g = 0 if i % 2 == 0 else 1 + (i // 2) % (groups - 1)
        out.append(systems[g] + [rng.choice(vocab) for _ in range(question_len)])
    rng.shuffle(out)
    return out


def simulate(policy, prompts: list[list[int]], wave: int, pool: int, n_workers: int = 2):
    """Waves of `wave` requests in flight at once; each worker's cache an LRU prefix tree of `pool`
    tokens. Returns (requests per worker, cached prompt tokens / prompt tokens)."""
    workers = [Worker(id=f"worker-{i}", url=f"http://127.0.0.1:{9000 + i}") for i in range(n_workers)]
    caches = {w.id: PrefixTree(pool) for w in workers}
    token, cached, total = 0, 0, 0
    for start in range(0, len(prompts), wave):
        inflight = []
        for p in prompts[start:start + wave]:
            w, _ = policy.choose(workers, RoutingKeys(None, p))
            w.start_request(token, None)
            cached += min(caches[w.id].match_len(p, touch=True), len(p) - 1)
            total += len(p)
            caches[w.id].insert(p)
            inflight.append((w, token))
            token += 1
        for w, t in inflight:
            w.end_request(t)
        assert all(w.outstanding_work == 0 and w.load == 0 for w in workers)
    return sorted(w.requests for w in workers), cached / total


@pytest.mark.parametrize("groups", [4, 6])
def test_balanced_spreads_a_hot_group_and_keeps_more_cached_than_round_robin(groups):
    # 192 requests in waves of 8; each worker's cache holds about 3 of the 200-token system prompts
    prompts = skewed_prompts(random.Random(0), 192, groups=groups, system_len=200, question_len=20,
                             vocab=range(5, 900))
    config = BalanceConfig()
    rr = simulate(RoundRobin(), prompts, wave=8, pool=700)
    ca = simulate(CacheAware(config), prompts, wave=8, pool=700)
    bal = simulate(Balanced(config), prompts, wave=8, pool=700)
    # round_robin splits evenly and makes each worker cache every group; cache_aware keeps the hot
    # group on one worker and splits the work 2:1 or so
    assert rr[0] == [96, 96]
    assert ca[0][1] - ca[0][0] >= 30, ca
    # balanced: even within a few requests, and more cached than round_robin
    assert bal[0][1] - bal[0][0] <= 6, bal
    assert bal[1] > rr[1] + 0.05, (bal, rr)


def test_balanced_cost_and_decisions():
    policy = Balanced(BalanceConfig(cache_threshold=0.3, load_weight=0.25))
    a, b = Worker(id="worker-0", url="http://a:1"), Worker(id="worker-1", url="http://b:1")
    prefix = list(range(100))
    w, d = policy.choose([a, b], RoutingKeys(None, prefix + [1000]))
    assert (w, d) == (a, "fallback")  # nothing cached anywhere: the first in turn
    a.start_request(1, None)
    assert a.outstanding_work == 101 and a.load == 1
    # the same prefix: a holds it; its load, 0.25 x (101 outstanding + 1 request x the mean prompt
    # of 101) = 50.5, costs less than the 100 tokens b would have to compute: a again
    w, d = policy.choose([a, b], RoutingKeys(None, prefix + [1001]))
    assert (w, d) == (a, "matched")
    a.start_request(2, None)
    assert a.outstanding_work == 102
    # a's load with two in flight: 0.25 x (102 + 2 x 101) = 76, + 1 uncached: still a; a third tips it
    w, _ = policy.choose([a, b], RoutingKeys(None, prefix + [1002]))
    assert w is a
    a.start_request(3, None)
    w, d = policy.choose([a, b], RoutingKeys(None, prefix + [1003]))
    assert (w, d) == (b, "balanced")  # load outweighed the longer match on a
    b.start_request(4, None)
    for t in (1, 2, 3):
        a.end_request(t)
    assert a.outstanding_work == 0 and b.outstanding_work == 101 and a.load == 0
    # a is idle and holds the prefix: the cheapest and the longest match
    w, d = policy.choose([a, b], RoutingKeys(None, prefix + [1004]))
    assert (w, d) == (a, "matched")
    # no key (a body the router cannot read): the least loaded, no work booked
    w, _ = policy.choose([a, b], RoutingKeys(None, None))
    assert w is a and a.next_work == 0


# ============================================================================ real processes
@pytest.fixture(scope="module")
def balanced_workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("router-balanced")


def test_balanced_router_over_real_workers(server_model_dir, balanced_workdir):
    """Skewed traffic in waves of 8 through real routers over 2 CPU workers whose pools hold about
    half the system prompts each. Balanced computes fewer prompt tokens than round_robin in all
    and on its busiest worker (the one that sets a run's duration), and caches more; every worker
    gets a fair share of the requests. Counts of tokens and requests, not wall-clock throughput:
    the machine's speed must not decide the test."""
    from test_router import start_router, start_workers

    workers = start_workers(server_model_dir, balanced_workdir, 2)
    urls = [w.base_url for w in workers]
    vocab = range(5, min(900, workers[0].server_info()["vocab_size"]))
    prompts = skewed_prompts(random.Random(1), 48, groups=6, system_len=900, question_len=16, vocab=vocab)
    outcome = {}
    try:
        for policy in ("round_robin", "balanced"):
            for url in urls:
                assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
            before = [_prompt_counters(u) for u in urls]
            router = start_router(balanced_workdir, urls, policy)
            try:
                outcome[policy] = asyncio.run(_send_waves(router.base_url, prompts, wave=8))
                outcome[policy]["per_worker"] = sorted(
                    w["requests"] for w in httpx.get(router.base_url + "/workers", timeout=10).json()["workers"])
            finally:
                router.stop()
            after = [_prompt_counters(u) for u in urls]
            # prompt tokens each worker computed (not cached); the routers' health probes add a few
            outcome[policy]["computed"] = [(a[0] - a[1]) - (b[0] - b[1]) for a, b in zip(after, before)]
    finally:
        for w in workers:
            w.stop()
    rr, bal = outcome["round_robin"], outcome["balanced"]
    assert rr["failed"] == 0 and bal["failed"] == 0, outcome
    assert bal["cached"] > rr["cached"], outcome
    assert sum(bal["computed"]) < sum(rr["computed"]), outcome
    assert max(bal["computed"]) < max(rr["computed"]), outcome
    assert bal["per_worker"][0] >= 0.25 * sum(bal["per_worker"]), outcome


def _prompt_counters(url: str) -> tuple[float, float]:
    """(prompt tokens, cached prompt tokens) from a worker's /metrics."""
    totals = {"radixserve:prompt_tokens_total": 0.0, "radixserve:cached_prompt_tokens_total": 0.0}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["radixserve:prompt_tokens_total"], totals["radixserve:cached_prompt_tokens_total"]


async def _send_waves(base_url: str, prompts: list[list[int]], wave: int) -> dict:
    cached = failed = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        for start in range(0, len(prompts), wave):
            replies = await asyncio.gather(*(
                client.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0,
                                                     "ignore_eos": True})
                for p in prompts[start:start + wave]))
            for r in replies:
                if r.status_code != 200:
                    failed += 1
                    continue
                cached += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"cached": cached, "failed": failed}
