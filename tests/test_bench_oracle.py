"""The oracle hit rate on hand-made request sequences, against values worked out by hand."""

from __future__ import annotations

import pytest

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
