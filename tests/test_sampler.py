"""Sampling semantics on the CPU: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.sampling_params import SamplingParams
from radixserve.model.sampler import filter_probs, sample


def P(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


BASE = [0.4, 0.3, 0.15, 0.1, 0.05]  # sorted, so ranks are the indices


def test_temperature_one_is_softmax():
    out = filter_probs(logits_of(BASE)[None], [P(temperature=1.0)])[0]
    torch.testing.assert_close(out, torch.tensor(BASE), atol=1e-6, rtol=0)


def test_temperature_scales_logits():
    logits = torch.randn(3, 50)
    params = [P(temperature=t) for t in (0.5, 1.0, 2.0)]
    out = filter_probs(logits, params)
    for i, t in enumerate((0.5, 1.0, 2.0)):
        torch.testing.assert_close(out[i], torch.softmax(logits[i] / t, -1), atol=1e-6, rtol=0)


def test_top_k_keeps_k_most_likely():
    out = filter_probs(logits_of(BASE)[None], [P(top_k=2)])[0]
    torch.testing.assert_close(out, torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]), atol=1e-6, rtol=0)


def test_top_p_keeps_smallest_set_reaching_p():
    # 0.4 < 0.6 -> keep the second; 0.7 >= 0.6 -> stop there.
    out = filter_probs(logits_of(BASE)[None], [P(top_p=0.6)])[0]
    torch.testing.assert_close(out, torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]), atol=1e-6, rtol=0)
    # A tiny top_p still keeps the most likely token.
    out = filter_probs(logits_of(BASE)[None], [P(top_p=1e-6)])[0]
    torch.testing.assert_close(out, torch.tensor([1.0, 0, 0, 0, 0]), atol=1e-6, rtol=0)


def test_min_p_drops_tokens_below_fraction_of_max():
    # floor = 0.5 * 0.4 = 0.2: keeps 0.4 and 0.3.
    out = filter_probs(logits_of(BASE)[None], [P(min_p=0.5)])[0]
    torch.testing.assert_close(out, torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]), atol=1e-6, rtol=0)


def test_filters_apply_per_row():
    logits = logits_of(BASE)[None].repeat(4, 1)
    out = filter_probs(logits, [P(), P(top_k=1), P(top_p=0.8), P(min_p=0.3)])
    torch.testing.assert_close(out[0], torch.tensor(BASE), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1], torch.tensor([1.0, 0, 0, 0, 0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[2], torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85, atol=1e-6, rtol=0)
    torch.testing.assert_close(out[3], torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85, atol=1e-6, rtol=0)


def test_filters_combine():
    out = filter_probs(logits_of(BASE)[None], [P(top_k=3, top_p=0.6)])[0]
    torch.testing.assert_close(out, torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]), atol=1e-6, rtol=0)


def test_greedy_is_argmax():
    logits = torch.randn(6, 100)
    params = [P(temperature=0.0), P(top_k=1, temperature=1.5)] * 3
    assert sample(logits, params, [None] * 6) == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = torch.randn(4, 100)
    gen = torch.Generator().manual_seed(0)
    out = sample(logits, [P(temperature=0), P(temperature=1.0), P(temperature=0), P(top_k=5)], [None] * 4, gen)
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert out[3] in logits[3].topk(5).indices.tolist()


def test_sampled_tokens_respect_filters():
    logits = logits_of(BASE)[None].repeat(200, 1)
    gen = torch.Generator().manual_seed(1)
    out = sample(logits, [P(top_k=2)] * 200, [None] * 200, gen)
    assert set(out) == {0, 1}
    out = sample(logits, [P(min_p=0.5)] * 200, [None] * 200, gen)
    assert set(out) <= {0, 1}


def test_sampling_follows_the_distribution():
    n = 20000
    logits = logits_of(BASE)[None].repeat(n, 1)
    gen = torch.Generator().manual_seed(2)
    out = torch.tensor(sample(logits, [P(temperature=1.0)] * n, [None] * n, gen))
    freq = torch.bincount(out, minlength=5).float() / n
    torch.testing.assert_close(freq, torch.tensor(BASE), atol=0.015, rtol=0)
    # Temperature 0.5 squares the odds: p^2 / sum p^2.
    out = torch.tensor(sample(logits, [P(temperature=0.5)] * n, [None] * n, gen))
    freq = torch.bincount(out, minlength=5).float() / n
    sq = torch.tensor(BASE) ** 2
    torch.testing.assert_close(freq, sq / sq.sum(), atol=0.015, rtol=0)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_per_request_seed_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    steps = [torch.randn(3, 64) for _ in range(10)]
    seeded = P(temperature=1.0, seed=42)

    def run(batch_params, row):
        gens = [(_seeded(p.seed) if p.seed is not None else None) for p in batch_params]
        default = _seeded(7)
        return [sample(s, batch_params, gens, default)[row] for s in steps]  # generators persist

    alone = []
    gen = _seeded(42)
    for s in steps:
        alone.append(sample(s[1:2], [seeded], [gen], _seeded(0))[0])
    with_others = run([P(temperature=1.0), seeded, P(temperature=0)], row=1)
    assert alone == with_others
    # Another seed gives another stream.
    other = []
    gen = _seeded(43)
    for s in steps:
        other.append(sample(s[1:2], [P(temperature=1.0, seed=43)], [gen])[0])
    assert other != alone


@pytest.mark.parametrize("top_p", [1.0, 0.999999])
def test_no_token_with_zero_probability_is_drawn(top_p):
    logits = torch.full((500, 10), -1e4)
    logits[:, 3] = 0.0
    logits[:, 7] = 0.0
    gen = torch.Generator().manual_seed(3)
    out = sample(logits, [P(top_p=top_p, min_p=0.01)] * 500, [None] * 500, gen)
    assert set(out) == {3, 7}


def test_gather_logprobs_in_slices_equals_one_pass(monkeypatch):
    """Prompt log probabilities go through log_softmax a slice of rows at a time: same values."""
    from radixserve.model import logprobs as logprobs_module

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 50, generator=g)
    ids = torch.randint(0, 50, (10,), generator=g)
    whole = logprobs_module.gather_logprobs(logits, ids, [2] * 10)
    monkeypatch.setattr(logprobs_module, "SLICE_ROWS", 3)
    sliced = logprobs_module.gather_logprobs(logits, ids, [2] * 10)
    assert torch.equal(whole.chosen, sliced.chosen) and torch.equal(whole.top_ids, sliced.top_ids)
    assert torch.allclose(whole.top_values, sliced.top_values)
    expected = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).view(-1)
    assert torch.allclose(sliced.chosen, expected)
