"""FP8 on a CUDA GPU: the FP8 tensor-core GEMM (`torch._scaled_mm`) against the reference, and the
whole engine on FP8 weights and an FP8 KV cache. Skipped without CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from radixserve import Engine  # noqa: E402
from radixserve.kernels import compiled_variant_counts  # noqa: E402
from radixserve.model.layers.fp8 import (fp8_linear_reference, fp8_linear_scaled_mm,  # noqa: E402
                                         quantize_rows)
from radixserve.testing.fp8_checkpoint import write_fp8_checkpoint  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402
from test_fp8 import hf_fake_quant  # noqa: E402

MAX_NEW = 24
HOPPER_OR_ADA = torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    src = build_tiny_model(tmp_path_factory.mktemp("tiny-fp8-src"))
    return write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8") / "tiny-ct", fmt="compressed-tensors",
                                per_channel=True)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def engine_greedy(path, dtype: str, batch: list[list[int]], **settings) -> tuple[list[list[int]], Engine]:
    settings.setdefault("cuda_graph_max_bs", 16)
    engine = Engine(str(path), device="cuda", dtype=dtype, max_total_tokens=8192, **settings)
    res = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0,
                                                            "ignore_eos": True})
    engine.check_invariants()
    return [r["output_ids"] for r in res], engine


def hf_greedy(hf, batch: list[list[int]]) -> list[list[int]]:
    out = []
    for p in batch:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                              do_sample=False, pad_token_id=0)[0].tolist()
        out.append(ids[len(p):])
    return out


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Tokens before each sequence's first difference, over all tokens."""
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    return sum(common(a, b) for a, b in zip(ours, ref)) / sum(len(r) for r in ref)


@pytest.mark.skipif(not HOPPER_OR_ADA, reason="FP8 tensor cores: compute capability 8.9+")
@pytest.mark.parametrize("m,n,k", [(1, 4608, 3584), (300, 4608, 3584), (77, 896, 4864)])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("fused_quant", [False, True])
def test_scaled_mm_matches_reference(m, n, k, static, fused_quant):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    wq, scale = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    input_scale = torch.tensor([0.01], device="cuda") if static else None
    out = fp8_linear_scaled_mm(x, wq, scale, bias, input_scale, fused_quant=fused_quant)
    ref = fp8_linear_reference(x.float(), wq, scale, bias, input_scale)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert out.dtype == torch.bfloat16 and err < 1e-2


@pytest.mark.parametrize("graphs", [True, False])
def test_fp8_fp32_greedy_equals_reference(fp8_ckpt, graphs):
    """float32 activations take the reference GEMM on the GPU too: the same tokens as transformers
    on the dequantized weights with e4m3-rounded projection inputs."""
    batch = prompts(4, 500, seed=1)
    ours, _ = engine_greedy(fp8_ckpt.path, "float32", batch, disable_cuda_graph=not graphs)
    assert ours == hf_greedy(hf_fake_quant(fp8_ckpt.dequantized, {}, device="cuda"), batch)


def test_fp8_bf16_close_to_reference(fp8_ckpt):
    """bf16 with the Triton kernels (the FP8 decode-row GEMM, cuBLASLt FP8 for prefill): most
    greedy tokens agree with the fake-quantized bf16 reference (bf16 rounds differently)."""
    batch = prompts(6, 500, seed=11)
    ours, engine = engine_greedy(fp8_ckpt.path, "bfloat16", batch)
    assert engine.core.model.kernels.triton and engine.core.runner.num_graph_steps > 0
    ref = hf_greedy(hf_fake_quant(fp8_ckpt.dequantized, {}, torch.bfloat16, "cuda"), batch)
    assert agreement(ours, ref) >= 0.5, (ours, ref)


def test_fp8_kv_cache_close_to_bf16_kv(fp8_ckpt):
    batch = prompts(6, 500, seed=12)
    plain, _ = engine_greedy(fp8_ckpt.path, "bfloat16", batch)
    fp8_kv, engine = engine_greedy(fp8_ckpt.path, "bfloat16", batch, kv_cache_dtype="fp8_e4m3")
    assert engine.core.kv_pool.k_buffers[0].dtype == torch.float8_e4m3fn
    assert agreement(fp8_kv, plain) >= 0.5, (fp8_kv, plain)


def test_fp8_graphs_on_off_same_tokens(fp8_ckpt):
    batch = prompts(4, 500, seed=7)
    on, engine = engine_greedy(fp8_ckpt.path, "bfloat16", batch, kv_cache_dtype="fp8_e4m3")
    assert engine.core.runner.num_graph_steps > 0
    off, _ = engine_greedy(fp8_ckpt.path, "bfloat16", batch, kv_cache_dtype="fp8_e4m3", disable_cuda_graph=True)
    assert on == off


def test_fp8_kv_pool_holds_twice_the_tokens(fp8_ckpt):
    sizes = {}
    for kv in ("auto", "fp8_e4m3"):
        engine = Engine(str(fp8_ckpt.path), device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                        mem_fraction_static=0.3, skip_warmup=True, disable_cuda_graph=True)
        sizes[kv] = engine.core.pool_size
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    assert 1.9 < sizes["fp8_e4m3"] / sizes["auto"] < 2.1, sizes


def test_no_kernel_compiles_after_warmup_fp8(fp8_ckpt):
    engine = Engine(str(fp8_ckpt.path), device="cuda", dtype="bfloat16", max_total_tokens=32768,
                    cuda_graph_max_bs=16, chunked_prefill_size=96, kv_cache_dtype="fp8_e4m3")
    before = compiled_variant_counts()
    assert before["decode_linear_fp8"] > 0
    rng = random.Random(0)
    for n in (1, 3, 17, 41, 5):
        batch = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 150))] for _ in range(n)]
        engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert compiled_variant_counts() == before
