"""Log probabilities, penalties, min_new_tokens and logit_bias in the offline Engine, against Hugging
Face's logits and generate() on the same weights (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.testing.tiny_model import build_tiny_model

import transformers  # noqa: E402  a required dependency: a broken install fails here, never skips

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 10
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sampling-tiny"))


@pytest.fixture(scope="module")
def hf(tiny):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(str(tiny), max_total_tokens=4096)


@pytest.fixture(scope="module")
def engine_no_overlap(tiny):
    return Engine(str(tiny), max_total_tokens=4096, disable_overlap_schedule=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def greedy(**extra) -> dict:
    # min_new_tokens == max_new_tokens masks EOS the way HF's min_new_tokens does.
    return {"max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW, "temperature": 0, **extra}


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_equal_hf_log_softmax(hf, engine, engine_no_overlap, overlap):
    eng = engine if overlap else engine_no_overlap
    ps = prompts(6, seed=1)
    # Rows that ask and rows that do not share the batch; one samples at temperature 0.7: its
    # log probabilities are still the model's own (before temperature).
    params = [greedy(return_logprob=True, top_logprobs_num=5), greedy(),
              greedy(return_logprob=True), greedy(return_logprob=True, top_logprobs_num=20),
              {"max_new_tokens": MAX_NEW, "temperature": 0.7, "seed": 5, "return_logprob": True,
               "top_logprobs_num": 3, "ignore_eos": True},
              greedy(return_logprob=True, top_logprobs_num=1, repetition_penalty=1.3)]
    results = eng.generate(input_ids=ps, sampling_params=params)
    for p, param, result in zip(ps, params, results):
        meta = result["meta_info"]
        if not param.get("return_logprob"):
            assert "output_token_logprobs" not in meta
            continue
        out = result["output_ids"]
        ref = hf_logprobs(hf, p + out)
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out
        for k, token in enumerate(out):
            row = ref[len(p) - 1 + k]
            assert meta["output_token_logprobs"][k][0] == pytest.approx(row[token].item(), abs=ATOL)
            top = meta["output_top_logprobs"][k]
            n = param.get("top_logprobs_num", 0)
            assert len(top) == n
            if n:
                ref_values = row.topk(n).values.tolist()
                assert [v for v, _, _ in top] == pytest.approx(ref_values, abs=ATOL)
                for value, token_id, _ in top:
                    assert value == pytest.approx(row[token_id].item(), abs=ATOL)
            if param["temperature"] == 0 and "repetition_penalty" not in param:
                assert token == row.argmax().item() or row[token] >= row.max() - ATOL
    engine.check_invariants()


@pytest.mark.parametrize("overlap", [True, False])
def test_repetition_penalty_equals_hf_generate(hf, engine, engine_no_overlap, overlap):
    eng = engine if overlap else engine_no_overlap
    ps = prompts(5, seed=2)
    penalties = [1.5, 1.0, 0.7, 2.0, 1.2]
    results = eng.generate(input_ids=ps, sampling_params=[greedy(repetition_penalty=r) for r in penalties])
    with torch.no_grad():
        for p, r, result in zip(ps, penalties, results):
            ids = torch.tensor([p])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=r, pad_token_id=0)
            assert result["output_ids"] == ref[0, len(p):].tolist(), f"repetition_penalty={r}"


def reference_penalized_greedy(hf, prompt: list[int], frequency: float, presence: float, n: int,
                               eos: int) -> list[int]:
    """Greedy decoding on HF logits minus OpenAI's penalties over the output so far, EOS masked."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[0]).float() \
            if out else torch.zeros_like(logits)
        logits -= frequency * counts + presence * (counts > 0).float()
        logits[eos] = float("-inf")
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("overlap", [True, False])
def test_frequency_and_presence_penalties_equal_direct_computation(hf, engine, engine_no_overlap, overlap):
    eng = engine if overlap else engine_no_overlap
    eos = hf.config.eos_token_id
    ps = prompts(4, seed=3)
    settings = [(2.0, 0.0), (0.0, 2.0), (0.5, -1.0), (-2.0, 1.5)]
    # A long enough run that penalised tokens come back around.
    params = [{**greedy(frequency_penalty=f, presence_penalty=pr), "max_new_tokens": 16, "min_new_tokens": 16}
              for f, pr in settings]
    results = eng.generate(input_ids=ps, sampling_params=params)
    for p, (f, pr), result in zip(ps, settings, results):
        assert result["output_ids"] == reference_penalized_greedy(hf, p, f, pr, 16, eos), (f, pr)
    # Without penalties the same prompts repeat tokens the penalties steer away from (the test has teeth).
    plain = eng.generate(input_ids=ps, sampling_params=[{**greedy(), "max_new_tokens": 16, "min_new_tokens": 16}] * 4)
    assert any(a["output_ids"] != b["output_ids"] for a, b in zip(plain, results))


def test_min_new_tokens_never_ends_early(engine):
    prompt = prompts(1, seed=4)[0]
    free = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                               "ignore_eos": True})
    stop = free["output_ids"][0]  # the token greedy decoding emits first
    early = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                "stop_token_ids": [stop]})
    assert early["output_ids"] == [stop] and early["meta_info"]["finish_reason"]["type"] == "stop"
    for overlap_engine in (engine,):
        held = overlap_engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop], "min_new_tokens": 6})
        out = held["output_ids"]
        assert len(out) >= 6 and stop not in out[:6]
        if held["meta_info"]["finish_reason"]["type"] == "stop":
            assert out[-1] == stop and stop not in out[:-1]
    # Sampled rows too (EOS included among the masked tokens).
    for seed in range(4):
        sampled = engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 8, "temperature": 1.0, "seed": seed, "stop_token_ids": [stop], "min_new_tokens": 8})
        assert len(sampled["output_ids"]) == 8 and stop not in sampled["output_ids"]


def test_logit_bias_forces_and_bans_tokens(engine):
    ps = prompts(3, seed=5)
    forced = engine.generate(input_ids=ps, sampling_params=[
        {"max_new_tokens": 6, "temperature": 0, "logit_bias": {"42": 100}},
        {"max_new_tokens": 6, "temperature": 1.0, "seed": 1, "logit_bias": {42: 100.0}},
        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}])
    assert forced[0]["output_ids"] == [42] * 6
    assert forced[1]["output_ids"] == [42] * 6
    assert forced[2]["output_ids"] != [42] * 6  # the row without a bias is untouched
    first = forced[2]["output_ids"][0]
    banned = engine.generate(input_ids=ps[2], sampling_params={"max_new_tokens": 1, "temperature": 0,
                                                                "ignore_eos": True, "logit_bias": {first: -100}})
    assert banned["output_ids"][0] != first


def test_bad_values_raise(engine):
    bad = [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
           {"min_new_tokens": -1}, {"min_new_tokens": 20, "max_new_tokens": 10}, {"logit_bias": {"7": 101}},
           {"logit_bias": {"x": 1}}, {"top_logprobs_num": 21}, {"top_logprobs_num": 3}, {"return_logprob": "yes"}]
    for values in bad:
        with pytest.raises(ValueError):
            engine.generate(input_ids=[1, 2, 3], sampling_params=values)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate(input_ids=[1, 2, 3], sampling_params={"logit_bias": {"100000": 1}})
    engine.check_invariants()


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_equal_hf_log_softmax(hf, tiny, chunked):
    """logprob_start_len: the prompt tokens' log probabilities from that position on, with the
    prompt's prefix cached before (reused only up to the first scored position) and over chunked
    prefill (gathered across chunks); other requests of the batch are unaffected."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompt = shared + [rng.randrange(3, 500) for _ in range(20)]
    extra = {"chunked_prefill_size": 16} if chunked else {}
    eng = Engine(str(tiny), max_total_tokens=4096, **extra)
    eng.generate(input_ids=shared + [5, 6, 7], sampling_params=greedy())  # caches the shared prefix
    for start in (0, 1, 7, 45, len(prompt) - 1):
        other = prompts(1, seed=start)[0]
        out, plain = eng.generate(input_ids=[prompt, other], sampling_params=[
            greedy(return_logprob=True, top_logprobs_num=3, logprob_start_len=start), greedy(return_logprob=True)])
        meta = out["meta_info"]
        ref = hf_logprobs(hf, prompt + out["output_ids"])
        entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert [t for _, t, _ in entries] == prompt[start:] and len(tops) == len(entries)
        for k, ((value, token, _), top) in enumerate(zip(entries, tops)):
            pos = start + k
            if pos == 0:
                assert value is None and top is None
                continue
            assert value == pytest.approx(ref[pos - 1, token].item(), abs=ATOL)
            assert [i for _, i, _ in top] == ref[pos - 1].topk(3).indices.tolist()
        assert meta["cached_tokens"] <= max(start - 1, 0)
        for k, (value, token, _) in enumerate(meta["output_token_logprobs"]):
            assert value == pytest.approx(ref[len(prompt) + k - 1, token].item(), abs=ATOL)
        assert "input_token_logprobs" not in plain["meta_info"]
        assert plain["output_ids"] == eng.generate(input_ids=other, sampling_params=greedy())["output_ids"]
    eng.check_invariants()
    with pytest.raises(ValueError, match="logprob_start_len"):
        eng.generate(input_ids=[1, 2], sampling_params=greedy(return_logprob=True, logprob_start_len=2))
    with pytest.raises(ValueError, match="needs return_logprob"):
        eng.generate(input_ids=[1, 2], sampling_params=greedy(logprob_start_len=0))
