"""The oracle hit rates (unlimited, LRU at capacity, Belady's MIN) on hand-made request sequences,
against values worked out by hand, and against each other on random ones."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from radixserve.bench.belady import belady_hit_rate
from radixserve.bench.oracle import OracleRequest, SimRadixCache, oracle_hit_rate


def R(prompt, output=()):
    return OracleRequest(prompt=list(prompt), output=list(output))


def test_unlimited_longest_common_prefix_with_any_earlier_request():
    seq = [R([1, 2, 3, 4]), R([1, 2, 3, 9]), R([1, 2, 7, 7, 7]), R([5, 6])]
    res = oracle_hit_rate(seq)
    # request 2 shares [1,2,3] with request 1; request 3 shares [1,2]; the last shares nothing.
    assert res.per_request_hits == [0, 3, 2, 0]
    assert res.prompt_tokens == 4 + 4 + 5 + 2
    assert res.hit_rate == pytest.approx(5 / 15)


def test_last_prompt_token_is_never_a_hit_and_outputs_are_cached():
    seq = [R([1, 2, 3], output=[4, 5]), R([1, 2, 3]), R([1, 2, 3, 4, 5, 6])]
    res = oracle_hit_rate(seq)
    # an identical prompt matches all but its last token; the third reuses prompt + output
    assert res.per_request_hits == [0, 2, 5]
    assert oracle_hit_rate(seq, match_cap=0).per_request_hits == [0, 3, 5]


def test_capacity_limited_lru_evicts_the_least_recently_used_leaf():
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    seq = [R(a + [0]), R(b + [0]), R(a + [9]), R(c + [0]), R(b + [8]), R(a + [7])]
    unlimited = oracle_hit_rate(seq)
    assert unlimited.per_request_hits == [0, 0, 4, 0, 4, 4]
    # 12 tokens of room: a+[0], b+[0] (10 tokens); request 3 hits a and adds [9] (11 tokens);
    # request 4 needs 5, 1 is free: the least recently used leaf is b's branch (5) -> evicted;
    # request 5 (b again) misses, needs 4 more: evicts [0] and [9] under a, then a itself (6);
    # request 6 (a again) misses and evicts c's branch (5).
    limited = oracle_hit_rate(seq, capacity=12)
    assert limited.per_request_hits == [0, 0, 4, 0, 0, 0]
    assert limited.evicted_tokens == 5 + 6 + 5
    assert limited.hit_rate == pytest.approx(4 / 30)


def test_capacity_too_small_for_anything_gives_zero_and_large_capacity_equals_unlimited():
    seq = [R([1, 2, 3, 4, 5]), R([1, 2, 3, 4, 6]), R([1, 2, 3, 4, 7])]
    assert oracle_hit_rate(seq, capacity=1000).per_request_hits == oracle_hit_rate(seq).per_request_hits
    small = oracle_hit_rate(seq, capacity=2)
    assert small.per_request_hits == [0, 2, 2]  # only the first two tokens fit
    assert oracle_hit_rate(seq, capacity=0).hit_tokens == 0


def test_sim_cache_counts_and_splits():
    cache = SimRadixCache(capacity=None)
    assert cache.insert([1, 2, 3, 4]) == 4
    assert cache.insert([1, 2, 5]) == 1  # splits [1,2,3,4] at 2
    assert cache.insert([1, 2, 3, 4]) == 0
    assert cache.size == 5
    assert cache.match([1, 2, 3, 9]) == 3
    assert cache.match([1, 2, 5, 6]) == 3
    assert cache.match([7]) == 0


def test_capacity_protects_the_path_the_request_matched():
    cache = SimRadixCache(capacity=6)
    cache.insert([1, 2, 3, 4])
    cache.insert([9, 9])  # 6 tokens: full
    # [1..7] is cut to the capacity (6 tokens); its matched path [1,2,3,4] is protected, so
    # [9,9] is evicted to make room for the 2 new tokens
    assert cache.insert([1, 2, 3, 4, 5, 6, 7]) == 2
    assert cache.size == 6
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.match([9, 9]) == 0
    with pytest.raises(ValueError):
        SimRadixCache(capacity=-1)


# ---------------------------------------------------------------------------- Belady's MIN
def test_belady_evicts_the_prefix_needed_furthest_in_the_future():
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    seq = [R(a + [0]), R(b + [0]), R(a + [9]), R(c + [0]), R(b + [8]), R(a + [7])]
    # 12 tokens: as for LRU up to request 4 (c), which needs 5 with 1 free. MIN first drops the
    # tails nobody asks for again (a's [0] and [9], b's [0]: 3 tokens), then one token of the
    # branch needed furthest ahead: a (request 6), not b (request 5). Request 5 adds [8]: c's [0]
    # goes (never used again). So b hits 4 and a hits 3, where LRU hit neither; the last request
    # still needs 2 tokens of room (a's fourth token and [7]).
    res = belady_hit_rate(seq, capacity=12)
    assert res.per_request_hits == [0, 0, 4, 0, 4, 3]
    assert res.evicted_tokens == 4 + 1 + 2
    assert res.hit_rate == pytest.approx(11 / 30)
    assert oracle_hit_rate(seq, capacity=12).hit_tokens == 4  # LRU
    assert oracle_hit_rate(seq).hit_tokens == 12  # unlimited


def test_belady_counts_the_tokens_running_requests_hold():
    A, B, C = [1] * 4, [2] * 4, [3] * 4
    seq = [R(A + [0]), R(B + [0]), R(C + [0]), R(B + [1]), R(A + [1])]
    # One at a time in 10 tokens: C's arrival evicts the unused tails and 3 tokens of A (needed
    # last); B survives for request 4, one token of A for request 5.
    assert belady_hit_rate(seq, capacity=10).per_request_hits == [0, 0, 0, 4, 1]
    # Two running at once: while C arrives, B's request still runs and holds B, so all of A
    # must go; B is kept for request 4, and A is a miss.
    two = belady_hit_rate(seq, capacity=10, running=2)
    assert two.per_request_hits == [0, 0, 0, 4, 0]
    # when the holds do not fit, the oldest running request finishes early
    assert belady_hit_rate(seq, capacity=6, running=3).early_finishes > 0


def test_belady_reserves_room_for_the_output_while_running():
    # the output (2 tokens) needs room while the request runs, even before it is cached
    seq = [R([1, 1, 1]), R([5], [6, 6]), R([1, 1, 1, 2])]
    assert belady_hit_rate(seq, capacity=6).per_request_hits == [0, 0, 3]
    assert belady_hit_rate(seq, capacity=5).per_request_hits == [0, 0, 2]


def test_belady_matches_whole_pages():
    seq = [R([1, 2, 3, 4, 5]), R([1, 2, 3, 4, 6]), R([1, 2, 3, 9, 9])]
    assert belady_hit_rate(seq, capacity=100).per_request_hits == [0, 4, 3]
    # pages of 2: the third request shares only the page (1, 2); a partial last page is never cached
    assert belady_hit_rate(seq, capacity=100, page_size=2).per_request_hits == [0, 4, 2]
    assert belady_hit_rate(seq, capacity=3, page_size=2).per_request_hits == [0, 2, 2]  # one page fits


def test_belady_bad_arguments():
    with pytest.raises(ValueError):
        belady_hit_rate([], capacity=-1)
    with pytest.raises(ValueError):
        belady_hit_rate([], capacity=10, page_size=0)
    with pytest.raises(ValueError):
        belady_hit_rate([], capacity=10, running=0)
    assert belady_hit_rate([], capacity=10).hit_rate == 0.0


def _random_trace(rng: random.Random, fresh) -> list[OracleRequest]:
    """Prompts over 3 symbols that often extend or cut an earlier prompt + output; outputs are
    fresh ids, so no output duplicates a cached token (there LRU's model and MIN's agree)."""
    reqs: list[OracleRequest] = []
    for _ in range(rng.randint(1, 25)):
        p = [rng.randint(0, 2) for _ in range(rng.randint(1, 10))]
        if reqs and rng.random() < 0.6:
            base = rng.choice(reqs)
            head = list(base.prompt) + list(base.output) if rng.random() < 0.5 else \
                list(base.prompt)[: rng.randint(0, len(base.prompt))]
            p = head + p
        reqs.append(R(p, [next(fresh) for _ in range(rng.randint(0, 4))]))
    return reqs


def test_belady_between_lru_and_unlimited_on_random_traces():
    rng, fresh = random.Random(0), itertools.count(100)
    strictly_better = 0
    for _ in range(400):
        reqs = _random_trace(rng, fresh)
        cap = rng.randint(0, 40)
        lru, best = oracle_hit_rate(reqs, capacity=cap), belady_hit_rate(reqs, capacity=cap)
        unlimited = oracle_hit_rate(reqs)
        assert lru.hit_tokens <= best.hit_tokens <= unlimited.hit_tokens, (cap, reqs)
        strictly_better += best.hit_tokens > lru.hit_tokens
        # more room, more running requests: never better, never worse respectively
        assert belady_hit_rate(reqs, capacity=cap + 5).hit_tokens >= best.hit_tokens
        assert belady_hit_rate(reqs, capacity=cap, running=3).hit_tokens <= best.hit_tokens
        assert belady_hit_rate(reqs, capacity=10**6).per_request_hits == unlimited.per_request_hits
    assert strictly_better > 50


def _prefixes(seq) -> set[tuple]:
    return {tuple(seq[:k]) for k in range(1, len(seq) + 1)}


def _closed_subsets(cached: frozenset) -> list[frozenset]:
    """Every prefix-closed subset of a prefix-closed set of token prefixes."""
    items, out = sorted(cached, key=len), []

    def walk(i: int, chosen: set) -> None:
        if i == len(items):
            out.append(frozenset(chosen))
            return
        walk(i + 1, chosen)
        if len(items[i]) == 1 or items[i][:-1] in chosen:
            chosen.add(items[i])
            walk(i + 1, chosen)
            chosen.discard(items[i])

    walk(0, set())
    return out


def _best_any_eviction(reqs: list[OracleRequest], capacity: int) -> int:
    """The most hit tokens over every possible choice of what to keep before each request (the
    same model as the bound: one request at a time, its prompt and output room held while it runs,
    its prompt + output cut to the capacity), by exhaustive search."""
    import functools

    @functools.lru_cache(maxsize=None)
    def best(j: int, cached: frozenset) -> int:
        if j == len(reqs):
            return 0
        prompt, output = list(reqs[j].prompt), list(reqs[j].output)
        target = prompt[:-1]
        hit = max(k for k in range(len(target) + 1) if k == 0 or tuple(target[:k]) in cached)
        full = (prompt + output)[:capacity]
        held, room = _prefixes(full[: len(prompt)]), len(full) - min(len(prompt), len(full))
        options = [best(j + 1, frozenset(kept | held | _prefixes(full))) for kept in _closed_subsets(cached)
                   if len(kept | held) + room <= capacity]
        return hit + max(options)

    return best(0, frozenset())


def test_belady_equals_the_exhaustive_optimum_on_small_traces():
    rng, fresh = random.Random(3), itertools.count(100)
    for _ in range(300):
        reqs: list[OracleRequest] = []
        for _ in range(rng.randint(1, 6)):
            p = [rng.randint(0, 1) for _ in range(rng.randint(1, 4))]
            if reqs and rng.random() < 0.6:
                base = rng.choice(reqs)
                p = (list(base.prompt) + list(base.output) if rng.random() < 0.5
                     else list(base.prompt)[: rng.randint(0, len(base.prompt))]) + p
            reqs.append(R(p[:6], [next(fresh) for _ in range(rng.randint(0, 2))]))
        cap = rng.randint(0, 8)
        assert belady_hit_rate(reqs, capacity=cap).hit_tokens == _best_any_eviction(reqs, cap), (cap, reqs)


def test_belady_is_fast_on_the_agent_workload_shape():
    """256 sessions x 5 turns over 8 system prompts of 2,048 tokens, a 216,825-token pool."""
    rng = random.Random(1)
    systems = [[rng.randrange(150_000) for _ in range(2048)] for _ in range(8)]
    sessions = []
    for _ in range(256):
        prompt, turns = list(rng.choice(systems)), []
        for _ in range(5):
            prompt = prompt + [rng.randrange(150_000) for _ in range(256)]
            out = [rng.randrange(150_000) for _ in range(128)]
            turns.append(R(prompt, out))
            prompt = prompt + out
        sessions.append(turns)
    seq = [s[t] for t in range(5) for s in sessions]
    start = time.process_time()
    best = belady_hit_rate(seq, capacity=216_825, page_size=16)
    assert time.process_time() - start < 30  # about 2 s of CPU time on one core
    # (LRU at this capacity reaches 0.690, the unlimited oracle 0.912)
    assert 0.83 < best.hit_rate < 0.85
