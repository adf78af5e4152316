"""Tensor parallelism on the CPU: 2 rank processes over gloo, the tiny model in fp32.

Greedy tokens with --tp-size 2 equal --tp-size 1 and Hugging Face generate() (prefix hits,
chunked prefill, retraction; a model whose single KV head is replicated on both ranks); seeded
sampling gives the same tokens as tp_size 1 (rank 0 samples, every rank records its ids); the
real server with --tp-size 2 through the openai SDK; killing a rank ends the server within 10 s.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ServerProcess
from test_engine import GREEDY, check_idle, hf_greedy, make_prompts
from test_server_lifecycle import children_of, pid_alive

from radixserve import Engine
from radixserve.bench.model_cost import ModelCost
from radixserve.distributed import HeadShard, head_shard, vocab_shard
from radixserve.launch_router import worker_gpus
from radixserve.launch_server import parse_settings
from radixserve.model.config import ModelConfig
from radixserve.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.timeout(300)

SAMPLED = {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def gqa2(tmp_path_factory):
    """4 query heads, 2 KV heads: one KV head per rank."""
    path = build_tiny_model(tmp_path_factory.mktemp("tp-gqa2"), num_heads=4, num_kv_heads=2)
    prompts = make_prompts(512)[:12]  # shared prefixes, a one-token prompt, a duplicate
    return path, prompts, hf_greedy(path, prompts)


@pytest.fixture(scope="module")
def kv1(tmp_path_factory):
    """4 query heads, 1 KV head (replicated on both ranks), tied embeddings (the vocab-parallel LM head
    shares the embedding's rows)."""
    path = build_tiny_model(tmp_path_factory.mktemp("tp-kv1"), num_heads=4, num_kv_heads=1, tie_word_embeddings=True)
    prompts = make_prompts(512, seed=1)[:12]
    return path, prompts, hf_greedy(path, prompts)


def test_tp2_equals_tp1_and_hf_with_prefix_hits_and_chunked_prefill(gqa2):
    path, prompts, expected = gqa2
    settings = {"max_total_tokens": 4096, "chunked_prefill_size": 7}
    with Engine(str(path), **settings) as single:
        assert [r["output_ids"] for r in single.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
        sampled = [r["output_ids"] for r in single.generate(input_ids=prompts[:6], sampling_params=SAMPLED)]
    with Engine(str(path), tp_size=2, **settings) as engine:
        assert engine.core.model.local_heads == (2, 1)
        assert engine.core.kv_pool.k_buffers[0].shape[1:] == (1, 16)  # this rank's KV head
        for _ in range(2):  # the second pass runs on a warm cache
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
            check_idle(engine)
        assert sum(r["meta_info"]["cached_tokens"] for r in results) == sum(len(p) - 1 for p in prompts)
        # Sampling: rank 0 samples and the ids reach every rank, so later steps agree with tp_size 1.
        assert [r["output_ids"] for r in engine.generate(input_ids=prompts[:6], sampling_params=SAMPLED)] == sampled


def test_tp2_prompt_logprobs_and_grammar_masks_equal_tp1(gqa2):
    """Prompt log probability rows travel in the broadcast step (every rank computes their logits);
    grammar masks are rank 0's alone, read while the ranks run the forward pass."""
    path, prompts, _ = gqa2
    params = [{"max_new_tokens": 5, "temperature": 0, "return_logprob": True, "top_logprobs_num": 2,
               "logprob_start_len": 0},
              {"max_new_tokens": 12, "temperature": 0.8, "seed": 3, "regex": "[a-z]{2,8}"},
              {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}]
    batch = [max(prompts, key=len), prompts[1], prompts[2]]
    runs = []
    for tp_size in (1, 2):
        with Engine(str(path), tp_size=tp_size, max_total_tokens=4096, chunked_prefill_size=7) as engine:
            runs.append(engine.generate(input_ids=batch, sampling_params=params))
    single, tp2 = runs
    assert [r["output_ids"] for r in tp2] == [r["output_ids"] for r in single]
    ref = single[0]["meta_info"]["input_token_logprobs"]
    got = tp2[0]["meta_info"]["input_token_logprobs"]
    assert len(got) == len(batch[0]) and got[0][0] is None
    assert [v for v, _, _ in got[1:]] == pytest.approx([v for v, _, _ in ref[1:]], abs=1e-4)


def test_tp2_replicates_a_single_kv_head_and_survives_retraction(kv1):
    path, prompts, expected = kv1
    # A small pool, and admission that reserves nothing for decode: the tree is evicted, then requests retract.
    with Engine(str(path), tp_size=2, max_total_tokens=96, chunked_prefill_size=16,
                schedule_conservativeness=0.0) as engine:
        assert engine.core.model.local_heads == (2, 1)
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected
        stats = engine.cache_stats()
        assert stats["retractions"] > 0 and stats["evicted_tokens"] > 0
        check_idle(engine)


def test_tp_sizes_the_model_cannot_split_are_refused(gqa2):
    path = gqa2[0]
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        Engine(str(path), tp_size=3)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        Engine(str(path), tp_size=0)
    with pytest.raises(ValueError, match="symm-mem needs CUDA"):
        Engine(str(path), tp_size=2, device="cpu", tp_all_reduce="symm-mem")
    assert parse_settings(["--tp", "2"]).tp_size == 2
    assert parse_settings(["--tp-size", "4", "--dp-size", "2"]).tp_size == 4
    # --dp-size 2 --tp-size 4 on 8 GPUs: each worker its own 4; too few GPUs: shared.
    assert [worker_gpus(i, 4, 8, 2) for i in range(2)] == ["0,1,2,3", "4,5,6,7"]
    assert worker_gpus(1, 1, 2, 2) == "1" and worker_gpus(0, 2, 2, 2) is None


def test_server_with_tp2_answers_and_a_dead_rank_ends_it(server_model_dir, server_workdir):
    with Engine(str(server_model_dir), max_total_tokens=4096) as single:
        expected = single.generate(prompt="The river ran past", sampling_params={
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True})["text"]
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--tp-size", "2",
                          "--max-total-tokens", "4096"], server_workdir).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt="The river ran past", max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == expected
        chat = client.chat.completions.create(model=model, max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": "What is the capital?"}])
        assert chat.usage.completion_tokens == 6 or chat.choices[0].finish_reason == "stop"
        assert proc.server_info()["settings"]["tp_size"] == 2

        engine_pid = proc.server_info()["engine_pid"]
        ranks = children_of(engine_pid)
        assert len(ranks) == 1, ranks  # rank 1; rank 0 is the engine process itself
        os.kill(ranks[0], signal.SIGKILL)
        killed_at = time.monotonic()
        code = proc.proc.wait(10)
        assert time.monotonic() - killed_at < 10.0
    finally:
        proc.stop(timeout_s=20)
    assert code != 0
    output = proc.output_path.read_text()
    assert f"tensor-parallel rank 1 (pid {ranks[0]}) exited (killed by signal 9)" in output, output[-3000:]
    assert not pid_alive(engine_pid)


def test_heads_split_or_replicate_and_the_vocabulary_pads():
    assert head_shard(64, 8, 8, 3) == HeadShard(num_q=8, q_start=24, num_kv=1, kv_start=3)
    # 2 KV heads over 4 ranks: each on the two ranks whose query heads read it.
    assert [head_shard(16, 2, 4, r) for r in range(4)] == [
        HeadShard(4, 0, 1, 0), HeadShard(4, 4, 1, 0), HeadShard(4, 8, 1, 1), HeadShard(4, 12, 1, 1)]
    with pytest.raises(ValueError, match="one must divide the other"):
        head_shard(12, 4, 6, 0)
    assert [vocab_shard(10, 4, r) for r in range(4)] == [(0, 3, 3), (3, 3, 3), (6, 3, 3), (9, 3, 1)]


def test_tp_decode_floor_adds_the_collectives_over_nvlink():
    cfg = ModelConfig.from_dir(Path(__file__).resolve().parents[1] / "benchmarks/configs/qwen2-72b")
    one, eight = ModelCost(cfg), ModelCost(cfg, tp=8)
    bw, link = 4.0e12, 450e9
    assert one.decode_floor_ms(64, 1024, bw, link) == pytest.approx(
        (one.decode_weight_bytes + 64 * 1024 * one.kv_bytes_per_token) / bw * 1e3)
    # Per GPU: an eighth of the weights (the replicated norms are negligible) and one of the 8 KV heads.
    assert eight.decode_weight_bytes == pytest.approx(one.decode_weight_bytes / 8, rel=1e-3)
    assert eight.kv_bytes_per_token == one.kv_bytes_per_token // 8
    # 161 all-reduces of [64, 8192] and the logits' all-gather, ring algorithms: 2 (N-1)/N and (N-1)/N.
    collective = 161 * 64 * 8192 * 2 * 2 * 7 / 8 + 64 * 152064 * 2 * 7 / 8
    assert eight.decode_collective_bytes(64) == pytest.approx(collective)
    assert eight.decode_floor_ms(64, 1024, bw, link) == pytest.approx(
        (eight.decode_weight_bytes + 64 * 1024 * eight.kv_bytes_per_token) / bw * 1e3 + collective / link * 1e3)


def test_a_stopped_rank_ends_the_server_within_seconds(server_model_dir, server_workdir):
    """A SIGSTOPped rank is alive but runs no collective: a request must not hang for the collective
    timeout; the engine counts the rank as dead within RANK_STOPPED_LIMIT_S, answers 503, and the
    server exits for its supervisor to restart it."""
    from radixserve.engine.tensor_parallel import RANK_STOPPED_LIMIT_S

    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--tp-size", "2",
                          "--max-total-tokens", "4096"], server_workdir).wait_ready()
    try:
        engine_pid = proc.server_info()["engine_pid"]
        (rank,) = children_of(engine_pid)
        os.kill(rank, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            r = httpx.post(f"{proc.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
            assert r.status_code == 503, r.text
        except httpx.HTTPError:
            pass  # the server may be gone before it answers
        code = proc.proc.wait(30)
        assert time.monotonic() - stopped_at < RANK_STOPPED_LIMIT_S + 20
    finally:
        if pid_alive(rank):
            os.kill(rank, signal.SIGKILL)
        proc.stop(timeout_s=20)
    assert code != 0
    assert f"tensor-parallel rank 1 (pid {rank}) has been stopped for" in proc.output_path.read_text()
    assert not pid_alive(rank) and not pid_alive(engine_pid)
