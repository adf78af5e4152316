"""The offline Engine against Hugging Face generate(), across scheduling, chunking, paging and memory pressure."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine.messages import GenerateRequest
from radixserve.model.config import ModelConfig
from radixserve.sampling_params import SamplingParams
from radixserve.testing.tiny_model import build_tiny_model

import transformers  # noqa: E402  a required dependency: a broken install fails here, never skips

MAX_NEW = 10
VARIANTS = {"untied-gqa2": dict(tie_word_embeddings=False, num_heads=4, num_kv_heads=2),
            "tied-gqa4": dict(tie_word_embeddings=True, num_heads=4, num_kv_heads=1)}


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """24 prompts of 1..70 tokens; most start with one of three shared "system prompts"."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 33, 21)]
    prompts = []
    for i in range(24):
        suffix = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        prompts.append((systems[i % 3] + suffix) if i % 4 else suffix)
    prompts[5] = [7]  # a one-token prompt
    prompts[6] = list(prompts[2])  # an exact duplicate
    return prompts


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=list(VARIANTS))
def oracle(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    prompts = make_prompts(512)
    return path, prompts, hf_greedy(path, prompts)


GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}

CONFIGS = {
    **{f"policy-{p}": dict(schedule_policy=p) for p in ("lpm", "fcfs", "lof", "random", "dfs-weight")},
    **{f"chunk{c}": dict(chunked_prefill_size=c) for c in (-1, 1, 7, 64)},
    "page4-chunk7": dict(page_size=4, chunked_prefill_size=7),
    "page4-lpm": dict(page_size=4),
    "radix-off": dict(disable_radix_cache=True),
    "radix-off-page4": dict(disable_radix_cache=True, page_size=4, chunked_prefill_size=7),
    "max-running-3": dict(max_running_requests=3, max_prefill_tokens=40),
    "fifo-small-pool": dict(radix_eviction_policy="fifo", max_total_tokens=400),
    "lfu-small-pool": dict(radix_eviction_policy="lfu", max_total_tokens=400),
    # Every config above runs with overlap scheduling (the default); these build each step only
    # after the previous step's tokens are back.
    "no-overlap": dict(disable_overlap_schedule=True),
    "no-overlap-small-pool-chunk7": dict(disable_overlap_schedule=True, max_total_tokens=400, chunked_prefill_size=7),
}


def check_logprobs_equal_hf(path: Path, prompts: list[list[int]], hf, max_new_tokens: int, atol: float) -> None:
    """The offline engine's prompt and output log probabilities (and the top 3 of each output
    token) over three of `prompts` (make_prompts' 2nd, 3rd and one-token 6th), chunked prefill of
    16, equal transformers' log_softmax (`hf`, float32) of the same tokens."""
    batch = [prompts[1], prompts[2], prompts[5]]
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, "return_logprob": True,
              "top_logprobs_num": 3, "logprob_start_len": 0}
    with Engine(str(path), max_total_tokens=4096, chunked_prefill_size=16) as engine:
        results = engine.generate(input_ids=batch, sampling_params=params)
    for prompt, result in zip(batch, results):
        meta, out = result["meta_info"], result["output_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + out])).logits[0].float(), dim=-1)
        for k, (value, token, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
            assert value == pytest.approx(ref[k - 1, token].item(), abs=atol)
        for k, ((value, token, _), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
            row = ref[len(prompt) - 1 + k]
            assert token == out[k] and value == pytest.approx(row[token].item(), abs=atol)
            assert [v for v, _, _ in top] == pytest.approx(row.topk(3).values.tolist(), abs=atol)


def check_greedy_cold_then_cached(path: Path, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """Greedy outputs equal `expected` cold and again warm, the second time with every prompt but
    its last token (recomputed for its logits) from the cache."""
    with Engine(str(path), max_total_tokens=4096) as engine:
        cold = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in cold] == expected
        warm = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in warm] == expected
        assert sum(r["meta_info"]["cached_tokens"] for r in warm) == sum(len(p) - 1 for p in prompts) > 0
        check_idle(engine)


def check_idle(engine: Engine) -> None:
    """Nothing runs or waits, and every KV slot and every recurrent-state snapshot slot (a hybrid
    model's, on both tiers) is free or the cache's, evictable: none is left with a request."""
    engine.check_invariants()
    stats = engine.cache_stats()
    assert stats["running_requests"] == stats["queued_requests"] == 0
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["pool_tokens"]
    snapshots = engine.core.kv_pool.snapshots
    if snapshots is not None:
        assert snapshots.free_slots + stats["snapshots_held"] == stats["snapshot_slots"] == snapshots.num_slots
        host = snapshots.host  # the host tier's snapshots, when it keeps some
        if host is not None:
            assert host.free_slots + stats["host_snapshots_held"] == stats["host_snapshot_slots"] == host.num_slots


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_hf(oracle, config):
    path, prompts, expected = oracle
    engine = Engine(str(path), **{"max_total_tokens": 4096, **CONFIGS[config]})
    for _ in range(2):  # the second pass runs on a warm cache
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected
        check_idle(engine)
    # On the warm pass each prompt finds all its whole pages but the last token cached, unless
    # a small pool evicted some of them in between.
    page = engine.settings.page_size
    full = sum((len(p) - 1) // page * page for p in prompts)
    warm = sum(r["meta_info"]["cached_tokens"] for r in results)
    if engine.settings.disable_radix_cache:
        assert warm == 0
    elif engine.cache_stats()["evicted_tokens"] == 0:
        assert warm == full
    else:
        assert 0 < warm < full


def test_memory_pressure_evicts_and_retracts_without_changing_output(oracle):
    path, prompts, expected = oracle
    # A small pool, and admission that reserves nothing for future decode tokens: decode runs out
    # of slots, evicts the tree and then retracts running requests.
    engine = Engine(str(path), max_total_tokens=96, chunked_prefill_size=16, schedule_conservativeness=0.0)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in results] == expected
    stats = engine.cache_stats()
    assert stats["evicted_tokens"] > 0
    assert stats["retractions"] > 0
    check_idle(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_memory_pressure_retracts_with_and_without_overlap(oracle, overlap):
    """With overlap, a retraction first waits for the step in flight (the scheduler collects it before retracting): same tokens."""
    path, prompts, expected = oracle
    engine = Engine(str(path), max_total_tokens=96, chunked_prefill_size=16, schedule_conservativeness=0.0,
                    disable_overlap_schedule=not overlap)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in results] == expected
    assert engine.cache_stats()["retractions"] > 0
    check_idle(engine)


def test_stop_tokens_found_one_step_late_give_the_same_output(oracle):
    """With overlap a stop token is seen after the next step was launched: that step's token for
    the finished request is dropped, and every request's output equals the non-overlapped run."""
    path, prompts, expected = oracle
    # Stop ids that end several requests early, at different steps, while others decode on.
    stop_ids = sorted({exp[k] for exp, k in zip(expected[::3], (1, 3, 5, 2, 4, 6, 1, 7))})
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "stop_token_ids": stop_ids}
    runs = {}
    for overlap in (True, False):
        engine = Engine(str(path), max_total_tokens=4096, disable_overlap_schedule=not overlap)
        runs[overlap] = [(r["output_ids"], r["meta_info"]["finish_reason"])
                         for r in engine.generate(input_ids=prompts, sampling_params=params)]
        check_idle(engine)
    assert runs[True] == runs[False]
    stopped = [out for out, reason in runs[True] if reason["type"] == "stop"]
    assert len(stopped) >= 4 and any(len(out) < MAX_NEW - 3 for out in stopped)
    for (out, reason), exp in zip(runs[True], expected):
        assert out == exp[:len(out)]
        if reason["type"] == "stop":
            assert out[-1] in stop_ids and not set(out[:-1]) & set(stop_ids)


def test_abort_while_a_step_is_in_flight(oracle):
    """Aborting requests between overlapped steps: their in-flight tokens are dropped, the rest
    finish as Hugging Face does, and every slot comes back."""
    path, prompts, expected = oracle
    engine = Engine(str(path), max_total_tokens=4096)
    core = engine.core
    from radixserve.engine.messages import GenerateRequest
    from radixserve.sampling_params import sampling_params_from_dict

    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        core.add_request(GenerateRequest(rid=rid, input_ids=p, sampling_params=sampling_params_from_dict(GREEDY)))
    outputs = {rid: [] for rid in rids}
    finished = {}
    steps = 0
    while core.has_work:
        for out in core.step():
            outputs[out.rid].extend(out.new_token_ids)
            if out.finished:
                finished[out.rid] = out.finish_reason.type
        steps += 1
        if steps in (2, 4, 6):  # abort two requests that are decoding with a step in flight
            for rid in [r for r in rids if r not in finished][:2]:
                out = core.abort(rid)
                outputs[rid].extend(out.new_token_ids)
                finished[rid] = "abort"
    assert sorted(finished) == sorted(rids)
    assert list(finished.values()).count("abort") == 6
    for rid, exp in zip(rids, expected):
        if finished[rid] == "abort":
            assert outputs[rid] == exp[:len(outputs[rid])]
        else:
            assert outputs[rid] == exp
    check_idle(engine)


def test_warmup_leaves_no_trace(oracle):
    """The start-up warm-up (run by default on CUDA) serves its requests and forgets them."""
    path, prompts, expected = oracle
    engine = Engine(str(path), max_total_tokens=4096)
    assert engine.core.warmup() > 0
    stats = engine.cache_stats()
    assert stats["prompt_tokens"] == stats["cached_prompt_tokens"] == stats["tree_nodes"] - 1 == 0
    assert stats["retractions"] == 0 and engine.core.scheduler.stats.admitted == 0
    check_idle(engine)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in results] == expected


def test_step_indices_start_on_16_byte_boundaries(tiny_dir):
    """Every index tensor of an eager step is a 16-byte aligned view of one buffer, whatever the
    batch's lengths (GPU kernels compile one variant per pointer alignment)."""
    from radixserve.engine.messages import GenerateRequest
    from radixserve.sampling_params import sampling_params_from_dict

    engine = Engine(str(tiny_dir), max_total_tokens=4096)
    core = engine.core
    for i, n in enumerate((3, 6, 1, 5)):
        core.add_request(GenerateRequest(rid=f"a{i}", input_ids=list(range(5, 5 + n)),
                                         sampling_params=sampling_params_from_dict(GREEDY)))
    batch = core.scheduler.schedule()
    fb = core.runner.build_forward_batch(batch)
    views = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens, fb.extend_lens,
             fb.prefix_lens, fb.logits_indices]
    assert [v.numel() for v in views] == [15, 15, 15, 4, 4, 4, 4, 4]
    assert all(v.data_ptr() % 16 == 0 for v in views)
    assert fb.input_ids.tolist() == [5, 6, 7, 5, 6, 7, 8, 9, 10, 5, 5, 6, 7, 8, 9]


def test_batch_compositions(oracle):
    path, prompts, expected = oracle
    engine = Engine(str(path), max_total_tokens=4096, chunked_prefill_size=7)
    # one at a time, then in uneven groups, then everything at once
    for i in (0, 5, 11):
        assert engine.generate(input_ids=prompts[i], sampling_params=GREEDY)["output_ids"] == expected[i]
    for lo, hi in ((0, 3), (3, 13), (13, 24)):
        got = engine.generate(input_ids=prompts[lo:hi], sampling_params=GREEDY)
        assert [r["output_ids"] for r in got] == expected[lo:hi]
    check_idle(engine)


def test_mixed_lengths_in_one_batch(oracle):
    """Requests with different max_new_tokens finish at different steps while others keep decoding."""
    path, prompts, expected = oracle
    engine = Engine(str(path), max_total_tokens=4096)
    params = [dict(GREEDY, max_new_tokens=1 + i % MAX_NEW) for i in range(len(prompts))]
    got = engine.generate(input_ids=prompts, sampling_params=params)
    for r, exp, p in zip(got, expected, params):
        assert r["output_ids"] == exp[: p["max_new_tokens"]]
        assert r["meta_info"]["finish_reason"]["type"] == "length"
    check_idle(engine)


# ------------------------------------------------------------------------------------------ prefix cache


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("page_size", [1, 4])
def test_cached_tokens_equal_shared_prefix(tiny_dir, page_size):
    engine = Engine(str(tiny_dir), max_total_tokens=4096, page_size=page_size)
    rng = random.Random(1)
    system = [rng.randrange(3, 500) for _ in range(42)]
    first = engine.generate(input_ids=system + [10, 11, 12], sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    later = engine.generate(input_ids=[system + [20 + i, 5, 6] for i in range(3)], sampling_params=GREEDY)
    expected = 42 - 42 % page_size
    assert [r["meta_info"]["cached_tokens"] for r in later] == [expected] * 3
    stats = engine.cache_stats()
    assert stats["prompt_tokens"] == 45 * 4
    assert stats["cached_prompt_tokens"] == 3 * expected
    check_idle(engine)


def test_in_batch_prefix_sharing_computes_the_prefix_once(tiny_dir):
    engine = Engine(str(tiny_dir), max_total_tokens=4096)
    rng = random.Random(2)
    shared = [rng.randrange(3, 500) for _ in range(64)]
    prompts = [shared + [100 + i, 7, 8] for i in range(4)]
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    cached = sorted(r["meta_info"]["cached_tokens"] for r in results)
    assert cached == [0, 64, 64, 64]
    # Three wait while the first one's prompt step is scheduled, and again while it is in flight
    # (overlap scheduling); then they find the prefix cached.
    assert engine.cache_stats()["in_batch_deferrals"] == 6
    check_idle(engine)


def test_disabled_cache_reuses_nothing(tiny_dir):
    engine = Engine(str(tiny_dir), max_total_tokens=4096, disable_radix_cache=True)
    for _ in range(2):
        r = engine.generate(input_ids=list(range(3, 60)), sampling_params=GREEDY)
        assert r["meta_info"]["cached_tokens"] == 0
    stats = engine.cache_stats()
    assert stats["free_tokens"] == stats["pool_tokens"] and stats["tree_nodes"] == 1
    check_idle(engine)


def test_flush_frees_everything(tiny_dir):
    engine = Engine(str(tiny_dir), max_total_tokens=4096)
    engine.generate(input_ids=list(range(3, 60)), sampling_params=GREEDY)
    assert engine.cache_stats()["evictable_tokens"] == 57 + MAX_NEW - 1  # the last token has no KV
    assert engine.flush_cache()
    stats = engine.cache_stats()
    assert stats["free_tokens"] == stats["pool_tokens"]
    again = engine.generate(input_ids=list(range(3, 60)), sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0


# ------------------------------------------------------------------------------------------ sampling & stops


def test_stop_token_ids_stop_strings_and_eos(tiny_dir):
    engine = Engine(str(tiny_dir), max_total_tokens=4096)
    prompt = "The quick brown fox jumps over"
    base = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    ids = base["output_ids"]
    stop_id = ids[4]
    first = ids.index(stop_id)
    r = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                        "stop_token_ids": [stop_id]})
    assert r["output_ids"] == ids[: first + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    text = base["text"]
    stop = text.strip().split(" ")[1] if " " in text.strip() else text[-2:]
    r = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": stop,
                                                        "ignore_eos": True})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in r["text"] and text.startswith(r["text"])
    check_idle(engine)


def test_seeded_sampling_is_reproducible(tiny_dir):
    engine = Engine(str(tiny_dir), max_total_tokens=4096)
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "seed": 1234}
    a = engine.generate(prompt="Once upon a time", sampling_params=params)
    b = engine.generate(prompt="Once upon a time", sampling_params=params)
    c = engine.generate(prompt="Once upon a time", sampling_params=dict(params, seed=99))
    assert a["output_ids"] == b["output_ids"]
    assert len(c["output_ids"]) == len(a["output_ids"]) or c["meta_info"]["finish_reason"]["type"] == "stop"


# ------------------------------------------------------------------------------------------ bad input


def test_bad_requests_raise_before_anything_is_allocated(tiny_dir):
    engine = Engine(str(tiny_dir), max_total_tokens=256, context_length=200)
    ok = {"max_new_tokens": 4, "temperature": 0}
    cases = [
        (dict(input_ids=[]), "empty"),
        (dict(prompt=""), "empty"),
        (dict(input_ids=[1, 2, 100000]), "outside the vocabulary"),
        (dict(input_ids=[1, -3]), "outside the vocabulary"),
        (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": 0}), "max_new_tokens"),
        (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": 199}), "context length"),
        (dict(input_ids=list(range(3, 250))), "context length"),
        (dict(input_ids=[1, 2], sampling_params={"temperature": -1}), "temperature"),
        (dict(input_ids=[1, 2], sampling_params={"top_p": 0}), "top_p"),
        (dict(input_ids=[1, 2], sampling_params={"bogus": 1}), "bogus"),
        (dict(input_ids=[[1, 2], []]), "empty"),
    ]
    for kwargs, needle in cases:
        kwargs.setdefault("sampling_params", ok)
        with pytest.raises(ValueError, match=needle):
            engine.generate(**kwargs)
        check_idle(engine)
    small = Engine(str(tiny_dir), max_total_tokens=64)
    with pytest.raises(ValueError, match="KV pool"):
        small.generate(input_ids=list(range(3, 80)), sampling_params=ok)
    # everyone else is still served
    assert len(engine.generate(input_ids=[1, 2, 3], sampling_params=ok)["output_ids"]) == 4


def test_bad_settings_and_model_dirs(tiny_dir, tmp_path):
    for kwargs, needle in [(dict(schedule_policy="nope"), "schedule_policy"),
                           (dict(radix_eviction_policy="mru"), "radix_eviction_policy"),
                           (dict(page_size=0), "page_size"), (dict(chunked_prefill_size=0), "chunked_prefill_size"),
                           (dict(no_such_setting=1), "no_such_setting")]:
        with pytest.raises(ValueError, match=needle):
            Engine(str(tiny_dir), **kwargs)
    with pytest.raises((FileNotFoundError, ValueError), match="config.json"):
        Engine(str(tmp_path))
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises((FileNotFoundError, ValueError), match="safetensors"):
        Engine(str(tmp_path))


def test_slow_steps_are_logged_with_their_batch(tiny_dir, caplog):
    """Every step at or over the threshold (here: all) is logged with its batch; on the CPU there
    are no kernel compiles or allocator retries to report."""
    import logging

    from radixserve.engine.engine_process import SlowStepWatch

    engine = Engine(str(tiny_dir), max_total_tokens=4096)
    watch = SlowStepWatch(cuda=False, threshold_s=0.0)
    engine.core.add_request(GenerateRequest(rid="slow", input_ids=[5, 6, 7, 8],
                                            sampling_params=SamplingParams(max_new_tokens=3, ignore_eos=True)))
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        while engine.core.has_work:
            engine.core.step()
            watch.after_step(engine.core)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow step:")]
    assert any("prefill/mixed, 4 new tokens" in line for line in lines), lines
    assert any("(decode, " in line for line in lines), lines
    assert all("compiled since the last slow step: none; CUDA allocator retries: +0" in line for line in lines)


@pytest.mark.parametrize("interval", [1, 4])
def test_outputs_come_every_stream_interval_and_once_at_the_end_unstreamed(tiny_dir, interval):
    """A streamed request's output every `stream_interval` tokens (its first token at once); a
    request that does not stream gets its first token and then everything at the end; the tokens
    are the same."""
    engine = Engine(str(tiny_dir), max_total_tokens=4096, stream_interval=interval)
    core = engine.core
    params = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 40))
    core.add_request(GenerateRequest(rid="streamed", input_ids=prompt, sampling_params=params))
    core.add_request(GenerateRequest(rid="whole", input_ids=prompt, sampling_params=params, stream=False))
    sizes: dict[str, list[int]] = {"streamed": [], "whole": []}
    tokens: dict[str, list[int]] = {"streamed": [], "whole": []}
    while core.has_work:
        for out in core.step():
            sizes[out.rid].append(len(out.new_token_ids))
            tokens[out.rid].extend(out.new_token_ids)
    assert sizes["streamed"] == ([1] * 9 if interval == 1 else [1, 4, 4])
    assert sizes["whole"] == [1, 8]
    assert tokens["streamed"] == tokens["whole"] and len(tokens["whole"]) == 9
    check_idle(engine)


def test_context_length_beyond_the_model_is_refused_unless_allowed(tiny_dir):
    positions = ModelConfig.from_dir(tiny_dir).max_position_embeddings
    with pytest.raises(ValueError, match=f"context_length {positions * 3} is more than the model's "
                                         f"max_position_embeddings {positions}.*--allow-longer-context-length"):
        Engine(str(tiny_dir), max_total_tokens=256, context_length=positions * 3)
    engine = Engine(str(tiny_dir), max_total_tokens=256, context_length=positions * 2, allow_longer_context_length=True)
    assert engine.core.context_len == positions * 2


def test_host_tier_beyond_host_memory_is_refused_before_the_model_loads(tiny_dir):
    with pytest.raises(ValueError, match="hicache_size=100000 needs 100000.0 GB of host memory; .* GB is available"):
        Engine(str(tiny_dir), max_total_tokens=256, hicache_size=100000)
