"""FP8 on the CPU reference path: FP8 checkpoints in each supported layout, quantization at load,
the FP8 KV cache, and the refusal of every other quantization method.

The oracle is transformers' Qwen2 loaded from the dequantized checkpoint (every projection weight
replaced by e4m3 weight x scale in float32), with each projection's input quantized to e4m3 and
back the way the FP8 GEMM sees it (per token, or the static per-tensor scale, the largest of a
fused q|k|v's or gate|up's). What is left between the two is float32 rounding, which can flip one
activation's e4m3 rounding now and then: hence a tolerance, not equality.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.attention.base import ForwardMode
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import FP8_KV_DTYPE, KVPool, fp8_dequantize, fp8_quantize, gather_fp8
from radixserve.engine.engine import Engine
from radixserve.model.config import ModelConfig
from radixserve.model.layers.fp8 import FP8_DTYPE, quantize_rows
from radixserve.model.loader import load_model
from radixserve.model.quantization import Fp8Config, quantization_config
from radixserve.testing.fp8_checkpoint import write_fp8_checkpoint
from radixserve.testing.tiny_model import build_tiny_model

import transformers  # noqa: E402

from conftest import ServerProcess, free_port  # noqa: E402
from test_model import PoolHarness, random_tokens  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
# Largest |ours - oracle| over all logits, relative to the largest |logit| (~3 on the tiny model).
# Measured: <= 2e-6 with the same e4m3 roundings; a flipped rounding moves a logit ~1e-3.
FP8_REL_TOL = 5e-3
# An FP8 KV cache (scale 1.0) against a float32 one, on the same weights: largest |delta logit|
# relative to the largest |logit|. Measured 0.03-0.05 on the tiny model (its K/V run to |4|, where
# e4m3 keeps 3 mantissa bits).
FP8_KV_REL_BOUND = 0.15

LAYOUTS = {
    # name: write_fp8_checkpoint keyword arguments
    "fp8-dynamic": dict(fmt="fp8"),
    "fp8-static": dict(fmt="fp8", static_activations=True),
    "ct-tensor": dict(fmt="compressed-tensors"),
    "ct-channel": dict(fmt="compressed-tensors", per_channel=True),
}
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fp8-src"), seed=1)


def static_scale_of(module: str, input_scales: dict[str, float]) -> float:
    """The activation scale a projection's input gets: a fused projection's largest."""
    prefix, _, leaf = module.rpartition(".")
    group = FUSED.get(leaf)
    if group is None:
        return input_scales[module]
    return max(v for name, v in input_scales.items()
               if name.rpartition(".")[0] == prefix and FUSED.get(name.rpartition(".")[2]) == group)


def hf_fake_quant(dequantized: Path, input_scales: dict[str, float], dtype: torch.dtype = torch.float32,
                  device: str = "cpu"):
    """transformers' model (its config's family) on the dequantized weights, each projection's input
    rounded to e4m3."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=dtype).to(device).eval()
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            static = static_scale_of(name, input_scales) if input_scales else None

            def hook(_m, args, static=static):
                x = args[0].float()
                if static is None:
                    scale = (x.abs().amax(dim=-1, keepdim=True) * (1.0 / 448.0)).clamp_min(1e-12)  # as the engine
                else:
                    scale = torch.tensor(static, device=x.device)
                return (((x / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale).to(args[0].dtype),)

            module.register_forward_pre_hook(hook)
    return hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prefix_extend_decode(model, cfg, prompt: list[int], *, kv_dtype=None, steps: int = 6
                         ) -> tuple[torch.Tensor, list[int]]:
    """Logits of every position: a prefix, an extend over it, then greedy decode steps; and the
    whole token sequence."""
    h = PoolHarness(model, cfg, page_size=2, seed=3)
    if kv_dtype is not None:
        h.pool = KVPool(4096, 2, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype, "cpu",
                        kv_scales=model.kv_cache_scales)
        pages = h.pool.allocator.alloc_pages(h.pool.allocator.num_pages)
        h._free_pages = pages[::-1]
    cut = len(prompt) // 2
    rows = [h.step({"a": prompt[:cut]})["a"], h.step({"a": prompt[cut:]})["a"]]
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(rows[-1][-1].argmax()))
        rows.append(h.step({"a": seq[-1:]}, mode=ForwardMode.DECODE)["a"])
    return torch.cat(rows), seq


# --------------------------------------------------------------------------- FP8 weights

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_checkpoint_matches_dequantized_reference(layout, tiny_dir, tmp_path):
    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / layout, **LAYOUTS[layout])
    model, cfg = load_model(ckpt.path, attn_backend=TorchAttentionBackend())
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (qkv.output_size,)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    hf = hf_fake_quant(ckpt.dequantized, ckpt.input_scales)
    prompt = random_tokens(21, cfg.vocab_size, 5)
    ours, seq = prefix_extend_decode(model, cfg, prompt)
    ref = hf_logits(hf, seq)
    assert rel_max(ours, ref) < FP8_REL_TOL


def test_quantize_at_load_matches_dequantized_reference(tiny_dir, tmp_path):
    """--quantization fp8 on a float32 checkpoint: per-output-channel weight scales, per-token
    activations; the same weights as a per-channel checkpoint's dequantized ones."""
    model, cfg = load_model(tiny_dir, attn_backend=TorchAttentionBackend(), quantization="fp8")
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "channel", fmt="compressed-tensors", per_channel=True)
    hf = hf_fake_quant(ckpt.dequantized, {})
    prompt = random_tokens(19, cfg.vocab_size, 6)
    ours, seq = prefix_extend_decode(model, cfg, prompt)
    assert rel_max(ours, hf_logits(hf, seq)[:ours.shape[0]]) < FP8_REL_TOL


def test_quantize_rows_is_per_output_channel():
    w = torch.randn(8, 32) * torch.logspace(-3, 1, 8)[:, None]
    w[3] = 0.0  # a zero row stays zero, with a finite scale
    wq, scale = quantize_rows(w)
    assert wq.dtype == FP8_DTYPE and scale.shape == (8,)
    assert torch.equal(wq.float().abs().amax(dim=1)[[0, 1, 2, 4, 5, 6, 7]], torch.full((7,), 448.0))
    assert torch.all(wq[3].float() == 0) and torch.isfinite(scale).all()
    rel = ((wq.float() * scale[:, None] - w).abs() / w.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)).max()
    assert rel <= 2 ** -4  # e4m3: 3 mantissa bits, half an ulp relative to the row's max


def test_dummy_weights_quantized_and_deterministic(tiny_dir):
    a, _ = load_model(tiny_dir, attn_backend=TorchAttentionBackend(), load_format="dummy", quantization="fp8", seed=3)
    b, _ = load_model(tiny_dir, attn_backend=TorchAttentionBackend(), load_format="dummy", quantization="fp8", seed=3)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa.float(), pb.float()), name
    down = a.model.layers[1].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE and float(down.weight_scale.min()) > 0


def test_fp8_tensor_without_quantization_config_is_refused(tiny_dir, tmp_path):
    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "undeclared")
    config = json.loads((ckpt.path / "config.json").read_text())
    del config["quantization_config"]
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config"):
        load_model(ckpt.path, attn_backend=TorchAttentionBackend())


def test_engine_serves_fp8_checkpoint_greedy_like_its_model(tiny_dir, tmp_path):
    """The engine's greedy tokens on an FP8 checkpoint are the FP8 model's own argmax chain."""
    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "engine", fmt="compressed-tensors", per_channel=True)
    model, cfg = load_model(ckpt.path, attn_backend=TorchAttentionBackend())
    prompt = random_tokens(15, cfg.vocab_size, 8)
    _, seq = prefix_extend_decode(model, cfg, prompt, steps=8)
    engine = Engine(model_path=str(ckpt.path), device="cpu")
    out = engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                               "ignore_eos": True})
    assert out[0]["output_ids"] == seq[len(prompt):len(prompt) + 8]


def test_server_serves_fp8_checkpoint_with_fp8_kv(tiny_dir, tmp_path):
    """A real server on an FP8 checkpoint with an FP8 KV cache: the OpenAI SDK's greedy completion
    is the offline engine's, and /server_info reports both settings."""
    import openai

    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "served", fmt="fp8", static_activations=True,
                                kv_scales=[(0.5, 0.5), (1.0, 2.0)])
    prompt = random_tokens(12, 512, 11)
    engine = Engine(model_path=str(ckpt.path), device="cpu", kv_cache_dtype="fp8_e4m3", max_total_tokens=4096)
    expected = engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                    "ignore_eos": True})[0]["output_ids"]
    engine.shutdown()
    server = ServerProcess(["--model-path", str(ckpt.path), "--device", "cpu", "--kv-cache-dtype", "fp8_e4m3",
                            "--max-total-tokens", "4096", "--skip-warmup"], tmp_path).wait_ready()
    try:
        settings = server.server_info()["settings"]
        assert settings["kv_cache_dtype"] == "fp8_e4m3" and settings["quantization"] is None
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        out = client.completions.create(model="served", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        assert engine_ids_text(ckpt.path, expected) == out.choices[0].text
    finally:
        server.stop()


def engine_ids_text(path: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path)).decode(ids)


# --------------------------------------------------------------------------- FP8 KV cache

def test_fp8_kv_pool_stores_scaled_values():
    pool = KVPool(16, 1, 2, 2, 8, FP8_KV_DTYPE, "cpu", kv_scales=[(1.0, 1.0), (0.5, 2.0)])
    assert KVPool.bytes_per_token(2, 2, 8, FP8_KV_DTYPE) * 2 == KVPool.bytes_per_token(2, 2, 8, torch.bfloat16)
    k, v = torch.randn(3, 2, 8) * 4, torch.randn(3, 2, 8) * 4
    k[0, 0, 0] = 1e4  # saturates at 448 * scale instead of becoming NaN
    slots = torch.tensor([1, 5, 9])
    pool.store(1, slots, k, v)
    assert pool.k_buffers[1].dtype == FP8_KV_DTYPE
    assert torch.equal(gather_fp8(pool.k_buffers[1], slots).float(), fp8_quantize(k, 0.5).float())
    back = fp8_dequantize(gather_fp8(pool.k_buffers[1], slots), 0.5, torch.float32)
    assert float(back[0, 0, 0]) == 448.0 * 0.5
    k[0, 0, 0] = 0.0
    back[0, 0, 0] = 0.0
    assert float(((back - k).abs() / k.abs().amax()).max()) <= 2 ** -4
    v_back = fp8_dequantize(gather_fp8(pool.v_buffers[1], slots), 2.0, torch.float32)
    assert float(((v_back - v).abs() / v.abs().amax()).max()) <= 2 ** -4


def test_fp8_kv_cache_changes_logits_within_bound(tiny_dir):
    model, cfg = load_model(tiny_dir, attn_backend=TorchAttentionBackend())
    prompt = random_tokens(23, cfg.vocab_size, 9)
    plain, seq = prefix_extend_decode(model, cfg, prompt)
    fp8, seq8 = prefix_extend_decode(model, cfg, prompt, kv_dtype=FP8_KV_DTYPE)
    # Compare the same positions only while the greedy chains agree.
    same = next((i for i, (a, b) in enumerate(zip(seq, seq8)) if a != b), len(seq))
    rows = min(same, plain.shape[0])
    assert rows >= len(prompt)
    err = rel_max(fp8[:rows], plain[:rows])
    assert 0 < err < FP8_KV_REL_BOUND


def test_kv_scales_read_from_checkpoint(tiny_dir, tmp_path):
    ckpt = write_fp8_checkpoint(tiny_dir, tmp_path / "kv", kv_scales=[(0.5, 0.25), (2.0, 1.5)])
    model, _ = load_model(ckpt.path, attn_backend=TorchAttentionBackend())
    assert model.kv_cache_scales == [(0.5, 0.25), (2.0, 1.5)]
    engine = Engine(model_path=str(ckpt.path), device="cpu", kv_cache_dtype="fp8_e4m3", max_total_tokens=256)
    pool = engine.core.kv_pool
    assert pool.k_scales == [0.5, 2.0] and pool.v_scales == [0.25, 1.5]
    assert pool.k_buffers[0].dtype == FP8_KV_DTYPE
    out = engine.generate(input_ids=[[3, 4, 5, 6]], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                      "ignore_eos": True})
    assert len(out[0]["output_ids"]) == 4


# --------------------------------------------------------------------------- refusal

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
REFUSED = {
    "awq": AWQ,
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "gguf": {"quant_method": "gguf"},
    "weight_block_size": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
    "int4": {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
    "keeping layers unquantized": {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_quantization_refused_offline(name, tiny_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = REFUSED[name]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=name) as info:
        Engine(model_path=str(model_dir), device="cpu")
    assert "supported" in str(info.value)
    with pytest.raises(ValueError, match=name):
        ModelConfig.from_dir(model_dir)


def test_awq_refused_at_server_startup(tiny_dir, tmp_path):
    model_dir = tmp_path / "awq-model"
    shutil.copytree(tiny_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = AWQ
    (model_dir / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-m", "radixserve.launch_server", "--device", "cpu", "--model-path",
                          str(model_dir), "--port", str(free_port())], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 1
    assert len(lines) == 1 and "server failed: " in lines[0], lines
    assert "'awq' is not supported" in lines[0] and "compressed-tensors" in lines[0], lines


def test_quantization_config_parsing():
    assert quantization_config({}) is None
    assert quantization_config({}, "fp8") == Fp8Config(from_checkpoint=False)
    static = quantization_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    assert static.from_checkpoint and static.static_activations and static.weight_scales == "tensor"
    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        quantization_config({}, "int8")
    with pytest.raises(ValueError, match="awq"):
        quantization_config({"quantization_config": AWQ}, "fp8")  # --quantization fp8 does not override it


def test_decode_floor_counts_one_byte_per_fp8_weight():
    from radixserve.bench.model_cost import ModelCost

    cfg = ModelConfig.from_dir(REPO_ROOT / "benchmarks" / "configs" / "qwen2-7b")
    bf16, fp8 = ModelCost(cfg), ModelCost(cfg, weight_elem=1)
    projections = cfg.num_hidden_layers * bf16.layer_projection_params
    saved = bf16.decode_weight_bytes - fp8.decode_weight_bytes
    # One byte saved per projection weight, less a float32 scale per output row.
    assert 0 < projections - saved < projections / 500
    # 7B: 14.14 GB read per decode step in bf16, 7.62 GB in FP8 (lm_head, 1.09 GB, stays bf16).
    assert 0.53 < fp8.decode_weight_bytes / bf16.decode_weight_bytes < 0.55


@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_call_matches_reference_on_cpu(static):
    """The arguments the CUDA prefill path gives torch._scaled_mm (row-wise scales, the weight
    column-major), checked where torch's CPU build runs it too."""
    from radixserve.model.layers.fp8 import fp8_linear_reference, fp8_linear_scaled_mm

    g = torch.Generator().manual_seed(int(static))
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    wq, scale = quantize_rows(torch.randn(48, 64, generator=g) * 0.02)
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    input_scale = torch.tensor([0.01]) if static else None
    try:
        out = fp8_linear_scaled_mm(x, wq, scale, bias, input_scale)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch build has no CPU FP8 GEMM: {e}")
    ref = fp8_linear_reference(x.float(), wq, scale, bias, input_scale)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2  # bf16 output rounding


def test_fp8_kv_cache_with_tensor_parallelism_equals_one_rank(tiny_dir, tmp_path):
    """Each rank's FP8 pool holds its KV heads with the model's per-layer scales: 2 ranks give the
    tokens 1 rank gives (the tiny model has 2 KV heads: one a rank)."""
    # The dequantized twin: plain weights carrying the KV scales, so the KV cache is the only FP8 part
    # (FP8 weights under tensor parallelism: test_fp8_tensor_parallel.py).
    plain = write_fp8_checkpoint(tiny_dir, tmp_path / "tp-kv", kv_scales=[(0.5, 0.25), (1.0, 2.0)]).dequantized
    prompts = [random_tokens(n, 512, 20 + n) for n in (5, 9, 14)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    settings = {"device": "cpu", "kv_cache_dtype": "fp8_e4m3", "max_total_tokens": 2048}
    with Engine(str(plain), **settings) as single:
        assert single.core.kv_pool.k_scales == [0.5, 1.0]
        expected = [r["output_ids"] for r in single.generate(input_ids=prompts, sampling_params=params)]
    with Engine(str(plain), tp_size=2, **settings) as engine:
        assert engine.core.kv_pool.k_buffers[0].dtype == FP8_KV_DTYPE and engine.core.kv_pool.v_scales == [0.25, 2.0]
        assert [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)] == expected


def test_fp8_kv_cache_round_trips_through_the_host_tier(tiny_dir):
    """An FP8 pool's bytes go to the host tier and come back unchanged: the second pass over
    prompts the device evicted finds them on the host and decodes what the first pass decoded."""
    import random as _random

    rng = _random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(6)]  # 384 tokens, pool of 128
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    engine = Engine(str(tiny_dir), device="cpu", kv_cache_dtype="fp8_e4m3", max_total_tokens=128, hicache_ratio=8)
    first = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    second = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    assert [r["output_ids"] for r in second] == [r["output_ids"] for r in first]
    assert all(r["meta_info"]["cached_tokens"] == 63 for r in second)
    assert engine.cache_stats()["loaded_tokens"] >= 6 * 63


@pytest.mark.parametrize("gated", [False, True])
def test_projection_takes_activations_the_norm_quantized(gated):
    """What the RMSNorm in front hands q|k|v and gate|up with the Triton kernels (Fp8Activations:
    e4m3 rows and per-token scales) is what a projection makes of the bf16 rows itself, and the
    projection multiplies it as it is: the result equals fp8_linear_reference on the normed bf16
    rows (then SiLU-and-mul for a gate|up), bit for bit, here on the reference GEMM."""
    from radixserve.model.layers import KernelChoice, MergedLinear, RMSNorm, SiluAndMul
    from radixserve.model.layers.fp8 import Fp8Activations, fp8_linear_reference, quantize_activations

    g = torch.Generator().manual_seed(int(gated))
    k, half, dtype, kernels = 64, 24, torch.bfloat16, KernelChoice()
    act = SiluAndMul(kernels=kernels) if gated else None
    layer = MergedLinear(k, {0: half, 1: half}, bias=not gated, dtype=dtype, kernels=kernels, act=act,
                         fp8=Fp8Config(from_checkpoint=False))
    norm = RMSNorm(k, 1e-6, dtype=dtype, kernels=kernels)
    with torch.no_grad():  # as the loader fills parameters
        for shard in (0, 1):
            layer.load_weight("weight", torch.randn(half, k, generator=g) * 0.05, shard)
            if not gated:
                layer.load_weight("bias", torch.randn(half, generator=g).to(dtype), shard)
        layer.finish_loading()
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
    x, residual = (torch.randn(7, k, generator=g).to(dtype) for _ in range(2))

    normed, summed = norm.forward(x, residual)
    acts, summed_too = norm.forward(x, residual, fp8=True)
    assert isinstance(acts, Fp8Activations) and acts.dtype == dtype and torch.equal(summed_too, summed)
    values, scales = quantize_activations(normed, None)
    assert torch.equal(acts.values.view(torch.uint8), values.view(torch.uint8)) and torch.equal(acts.scales, scales)
    assert torch.equal(norm.forward(x, fp8=True).scales, quantize_activations(norm.forward(x), None)[1])

    ref = fp8_linear_reference(normed, layer.weight, layer.weight_scale, layer.bias, None)
    ref = ref if act is None else act.forward(ref)
    out = layer.forward(acts)
    assert out.dtype == dtype and torch.equal(out, ref) and torch.equal(out, layer.forward(normed))
    empty = layer.forward(Fp8Activations(acts.values[:0], acts.scales[:0], dtype))
    assert empty.shape == (0, half if gated else 2 * half)


def test_which_projections_take_quantized_activations():
    """Only FP8 projections with the Triton kernels and per-token activation scales: the torch
    path quantizes in the projection, and a static input scale is not the norm's per-token one
    (handed Fp8Activations anyway, such a projection refuses them)."""
    from radixserve.model.layers import KernelChoice, Linear
    from radixserve.model.layers.fp8 import Fp8Activations

    def linear(triton: bool, activations: str = "dynamic", fp8: bool = True) -> Linear:
        config = Fp8Config(from_checkpoint=False, activations=activations) if fp8 else None
        return Linear(32, 16, bias=False, dtype=torch.bfloat16, fp8=config,
                      kernels=KernelChoice(triton=triton, decode_gemm_max_rows=0))

    assert linear(triton=True).takes_fp8_activations
    assert not linear(triton=False).takes_fp8_activations
    assert not linear(triton=True, activations="static").takes_fp8_activations
    assert not linear(triton=True, fp8=False).takes_fp8_activations
    static = linear(triton=False, activations="static")
    static.finish_loading()
    acts = Fp8Activations(torch.zeros(2, 32, dtype=FP8_DTYPE), torch.ones(2, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="static input scale"):
        static.forward(acts)
