"""Hybrid Qwen models (Gated DeltaNet + gated attention) on a CUDA GPU: the tiny Qwen3.5 and Qwen3-Next
give transformers' greedy tokens in fp32 with CUDA graphs (padded buckets write the state pool's
scratch row) and overlap on and off (transformers' own kernels where fla-core is installed: then
90% of them); in bf16 (the Triton kernels, fla's chunked prefill when
installed) graphs change no token, chunked prefill carries the states, and most tokens agree with
transformers' bf16; a Qwen3.5-27B-shaped model (head_dim 256, 16 key / 48 value heads of 128) with
2 of its layers runs with dummy weights through the memory plan (the state pool beside the KV pool)
and graphs; its Triton layers, and a Qwen3.6-35B-A3B-shaped model's (the fused MoE), close to their
torch layers; requests resumed from the prefix cache's recurrent-state snapshots (branch points
inside chunks, a conversation's next turn) give the cold pass's and transformers' tokens, with
graphs and overlap. Skipped without CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")


from radixserve import Engine  # noqa: E402
from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec  # noqa: E402
from radixserve.cache.factory import SNAPSHOT_SPAN_TOKENS  # noqa: E402
from radixserve.kernels import fla_gdn  # noqa: E402
from radixserve.model.loader import load_model  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

from greedy_oracle import (MAX_NEW, agreement, check_as_close_to_fp32_as_hf_bf16,  # noqa: E402
                           check_bf16_graphs_change_no_token, hf_greedy, hf_greedy_fp32_torch,
                           prompts)
from greedy_oracle import engine_greedy as _engine_greedy  # noqa: E402
from test_engine_gpu import _logits  # noqa: E402
from test_triton_layers import fp32_twin, within_low_precision_noise  # noqa: E402

# Qwen3.5-27B's text shapes (benchmarks/configs/qwen3.5-27b) with one linear and one full layer.
QWEN3_5_27B_2_LAYERS = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 5120,
    "intermediate_size": 17408, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "vocab_size": 248320,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "dtype": "bfloat16", "eos_token_id": 248044}
# Qwen3.6-35B-A3B's (benchmarks/configs/qwen3.6-35b-a3b): 256 experts of 512, top-8, a shared expert.
QWEN3_6_35B_A3B_2_LAYERS = {
    **{k: v for k, v in QWEN3_5_27B_2_LAYERS.items() if k != "intermediate_size"},
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_value_heads": 32, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def tiny_dir(request, tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}-gpu"), family=request.param,
                                layers=4, head_dim=32, seed=2))


@pytest.fixture(scope="module")
def qwen3_5_27b_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3.5-27b-2-layers")
    (path / "config.json").write_text(json.dumps(QWEN3_5_27B_2_LAYERS))
    return str(path)


def engine_greedy(path: str, dtype: str, batch: list[list[int]], **settings):
    """Ours on a hybrid, one pass over random prompts that share no prefix: nothing is reused."""
    return _engine_greedy(path, dtype, batch, expect_no_cache_hits=True, **settings)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("n", [1, 3, 8])  # 3: padded to the 4-row graph
def test_fp32_greedy_equals_hf(tiny_dir, graphs, n, overlap):
    batch = prompts(n, 500, seed=n)
    ours, engine = engine_greedy(tiny_dir, "float32", batch, disable_cuda_graph=not graphs,
                                 disable_overlap_schedule=not overlap)
    runner = engine.core.runner
    assert (runner.graphs is not None) == graphs
    if graphs:
        assert runner.num_graph_steps > 0
    ref = hf_greedy(tiny_dir, torch.float32, batch)
    if fla_gdn.available():
        # transformers then runs fla's kernels (TF32 dots) where ours are the float32 torch
        # reference: near-ties may be broken the other way.
        assert agreement(ours, ref) >= 0.9
    else:
        assert ours == ref


@pytest.mark.parametrize("overlap", [True, False])
def test_fp32_resumed_from_state_snapshots_equals_cold_and_hf(tiny_dir, overlap):
    """Six prompts under one 48-token system prompt, in 16-token chunks: the second request on it
    ends a piece at the branch point (inside a chunk) and keeps the state there, later ones resume
    there; the second pass resumes every prompt, and a conversation's next turn resumes where its
    last turn ended. Snapshots are copied on the compute stream between graph replays and eager
    prefills; every token is transformers' float32 torch path's (our 16-token pieces take the recurrent
    kernel, never fla's TF32 one). 64 snapshot slots as on the CPU (a CUDA pool of 8,192 tokens would
    get 8, one per 1,024 tokens: too few to keep every request's, which is not what this tests)."""
    system = prompts(1, 500, seed=11, longest=48)[0][:5] * 10  # 50 tokens
    batch = [system + p for p in prompts(6, 500, seed=12, longest=20)]
    ref = hf_greedy_fp32_torch(tiny_dir, batch)
    engine = Engine(tiny_dir, device="cuda", dtype="float32", max_total_tokens=8192, chunked_prefill_size=16,
                    cuda_graph_max_bs=16, disable_overlap_schedule=not overlap, mamba_cache_size=64)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    passes = [engine.generate(input_ids=batch, sampling_params=params) for _ in range(2)]
    cold, warm = ([r["output_ids"] for r in results] for results in passes)
    assert warm == cold == ref
    assert all(r["meta_info"]["cached_tokens"] >= len(system) for r in passes[1])
    stats = engine.cache_stats()
    assert stats["snapshot_hits"] > 0 and engine.core.runner.num_graph_steps > 0
    turn2 = batch[0] + cold[0] + [7, 8, 9, 10]
    second = engine.generate(input_ids=[turn2], sampling_params=params)[0]
    assert second["meta_info"]["cached_tokens"] == len(batch[0]) + MAX_NEW - 1
    assert second["output_ids"] == hf_greedy_fp32_torch(tiny_dir, [turn2])[0]
    engine.check_invariants()
    snapshots = engine.core.kv_pool.snapshots
    assert snapshots.free_slots + engine.cache_stats()["snapshots_held"] == snapshots.num_slots


def test_bf16_graphs_on_off_same_tokens_and_close_to_hf(tiny_dir):
    check_bf16_graphs_change_no_token(tiny_dir, expect_no_cache_hits=True, chaotic=True)


def test_bf16_chunked_prefill_carries_the_states(tiny_dir):
    """Prompts of up to 300 tokens whole (fla's chunked kernel where installed) and in chunks of 16
    (the recurrent kernel over each chunk, the state carried between them)."""
    batch = prompts(6, 500, seed=8, longest=300)
    whole, _ = engine_greedy(tiny_dir, "bfloat16", batch)
    chunked, _ = engine_greedy(tiny_dir, "bfloat16", batch, chunked_prefill_size=16)
    check_as_close_to_fp32_as_hf_bf16(tiny_dir, whole, batch)
    check_as_close_to_fp32_as_hf_bf16(tiny_dir, chunked, batch)


@pytest.mark.parametrize("shape", ["27b", "35b-a3b"])
def test_published_shapes_triton_layers_close_to_torch_layers(shape, tmp_path):
    """The 27B's and the 35B-A3B's layer shapes, one linear and one full layer each (the 35B-A3B's
    through the fused MoE), dummy weights (the same seed in both models)."""
    path = tmp_path / shape
    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN3_5_27B_2_LAYERS if shape == "27b" else QWEN3_6_35B_A3B_2_LAYERS))
    batch = prompts(5, 248000, seed=3, longest=200)
    def logits(model, cfg, dtype):
        pool = KVPool(4096, 1, cfg.num_kv_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, "cuda")
        pool.state = RecurrentStatePool(len(batch), RecurrentStateSpec(**model.recurrent_state_shape), "cuda")
        return _logits(model, pool, batch)

    out = {}
    for triton_kernels in (None, False):
        model, cfg = load_model(str(path), load_format="dummy", dtype=torch.bfloat16, device="cuda",
                                attn_backend=TritonAttentionBackend(), triton_kernels=triton_kernels, seed=5)
        assert model.model.layers[1].self_attn.head_dim == 256 and model.kernels.triton == (triton_kernels is None)
        out[triton_kernels] = logits(model, cfg, torch.bfloat16)
    truth = logits(fp32_twin(model, str(path), load_format="dummy"), cfg, torch.float32)
    assert torch.isfinite(out[None]).all()
    assert within_low_precision_noise(out[None], out[False], truth)


def test_qwen3_5_27b_shape_plans_its_state_pool_and_serves_with_graphs(qwen3_5_27b_dir):
    """No --max-total-tokens: the memory plan sizes the KV pool with the state pool and the prefix
    cache's snapshot pool allocated beside it (one row per running request: 2 x 16 key heads ... of
    this rank)."""
    batch = prompts(8, 248000, seed=4)
    # A budget of what is in use now plus 16 GiB (the 2-layer model takes ~7), not the default
    # share of the whole card: the other test workers on this GPU keep theirs.
    free, total = torch.cuda.mem_get_info()
    engine = Engine(qwen3_5_27b_dir, load_format="dummy", device="cuda", dtype="bfloat16", cuda_graph_max_bs=16,
                    max_running_requests=64, context_length=4096,
                    mem_fraction_static=(total - free + 16 * 2**30) / total)
    plan = engine.core.memory_plan
    state = engine.core.kv_pool.state
    assert plan.state_pool_rows == state.num_rows == 64 and plan.state_pool_bytes == state.total_bytes
    # The snapshot pool shares the planned pool's bytes: one snapshot per SNAPSHOT_SPAN_TOKENS of
    # the KV pool that is left, the remainder (less than one snapshot and one span) to the KV pool.
    snapshots = engine.core.kv_pool.snapshots
    assert plan.snapshot_slots == snapshots.num_slots > 0 and plan.snapshot_pool_bytes == snapshots.total_bytes
    snapshot_in_tokens = snapshots.bytes_per_slot // (plan.kv_pool_bytes // plan.kv_pool_tokens)
    assert (snapshots.num_slots * SNAPSHOT_SPAN_TOKENS <= plan.kv_pool_tokens
            <= (snapshots.num_slots + 1) * SNAPSHOT_SPAN_TOKENS + snapshot_in_tokens + 1)
    assert state.ssm[0].shape == (65, 48, 128, 128) and state.conv[0].shape == (65, 3, 2 * 16 * 128 + 48 * 128)
    assert plan.kv_pool_tokens > 0 and len(engine.core.kv_pool.k_buffers) == 1
    results = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                                "ignore_eos": True})
    assert all(len(r["output_ids"]) == 16 for r in results)
    assert engine.core.runner.num_graph_steps > 0
    engine.check_invariants()


@pytest.mark.parametrize("shape", ["27b", "35b-a3b"])
def test_bench_one_batch_times_a_hybrid_against_its_floors(shape, tmp_path, gpu_alone):
    """bench_one_batch on the 2-layer shapes, dummy weights: decode steps (eager and graphed) and a
    prefill, each beside its floor: the weights (the experts the batch touches), the full layer's
    KV and every request's states read and written, over the measured copy bandwidth; the prefill's
    FLOPs with the linear layer's chunked form, over the measured matmul rate. Alone on the GPU
    (`gpu_alone`): a copy bandwidth measured beside other workers' kernels puts the floor above
    the step (0.76x under -n 8 on an H100)."""
    from radixserve.bench.model_cost import ModelCost
    from radixserve.bench_one_batch import main
    from radixserve.model.config import ModelConfig

    path = tmp_path / shape
    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN3_5_27B_2_LAYERS if shape == "27b" else QWEN3_6_35B_A3B_2_LAYERS))
    out = tmp_path / "rows.json"
    assert main(["--model-path", str(path), "--batch-sizes", "1", "16", "--contexts", "1024", "--prefill-len", "2048",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    meta, rows = report["meta"], report["rows"]
    cost = ModelCost(ModelConfig.from_dir(path))
    assert meta["state_bytes_per_request"] == cost.state_bytes_per_request > 0
    steps = {r["label"]: r for r in rows if r["kind"] == "decode-step"}
    assert set(steps) == {"bs=1 ctx=1024", "bs=16 ctx=1024"} and all(r["graph"] for r in steps.values())
    for bs in (1, 16):
        row = steps[f"bs={bs} ctx=1024"]
        assert row["floor_ms"] == pytest.approx(cost.decode_bytes(bs, 1024) / meta["copy_bandwidth"] * 1e3)
        assert row["ratio"] > 0.8, row  # a floor the step beats by more than noise would be wrong
    prefill = next(r for r in rows if r["kind"] == "prefill")
    assert prefill["floor_ms"] == pytest.approx(cost.prefill_flops(1, 2048) / meta["matmul_flops"] * 1e3)
    assert prefill["ratio"] > 0.8, prefill
    assert any(r["kind"] == "decode-attn" for r in rows)  # the full layer's kernels alone


def test_a_resume_point_inside_a_chunk_is_as_exact_as_one_on_its_boundary(tmp_path_factory):
    """Every offset 1..150 past a 64-token base, float32 on the card (the CPU suite runs a few):
    the request resumed at the branch point gives transformers' tokens wherever it falls in a
    Gated DeltaNet chunk, and the resume points fall at every position of a chunk (offsets 15 and
    79 resume at a checkpoint instead, so 143 covers the fifteenth). The oracle is transformers'
    float32 torch path in a process without fla (whose kernels take no CPU tensors)."""
    from test_engine import GREEDY
    from test_hybrid import build, check_resumes_inside_chunks_equal_transformers

    def oracle(path, batch: list[list[int]]) -> list[list[int]]:
        return [out[:GREEDY["max_new_tokens"]] for out in hf_greedy_fp32_torch(str(path), batch)]

    resumed = check_resumes_inside_chunks_equal_transformers(build(tmp_path_factory, "qwen3_5", seed=4),
                                                             range(1, 151), device="cuda", oracle=oracle)
    assert {p % 64 for p in resumed} == set(range(64))
