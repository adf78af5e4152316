"""FP8 on a CUDA GPU: the FP8 tensor-core GEMM (`torch._scaled_mm`) against the reference, and the
whole engine on FP8 weights and an FP8 KV cache. Skipped without CUDA.

The engine in bf16 is compared with a reference teacher-forced over the engine's own tokens, not
by greedy agreement: the tiny random model's top two tokens are often closer than bf16's rounding
noise, and once a greedy sequence takes the other one every later token differs, so agreement
measures where the first near-tie falls rather than how close the numbers are. At every generated
position the reference must rank the engine's token within a tolerance of its best (greedy up to
numeric error) and give it the log probability the engine reported, within a tolerance.

The reference (`hf_fp8_reference`) is transformers' Qwen2 in float32 on the dequantized weights
with the engine's activation rounding: the engine quantizes every projection's input to e4m3 per
token on every path (the FP8 tensor-core GEMM of a prefill, the FP8 decode-row GEMM of a decode
step, the CPU's reference GEMM), so the reference rounds every position's.

Tolerances (log probabilities, nats): bf16 rounds every layer's output (2^-9 relative), and a
value that moves by that much crosses an e4m3 rounding boundary (steps of 2^-3 relative) now and
then and moves by a whole step, so bf16 noise of ~0.2% reaches the logits (|logit| up to ~3 on
this model) as ~1%. Measured with the CPU engine in bf16 against this float32 reference (every
position rounded, the CPU's FP8 path), 6 prompts x 24 tokens, 18 seeds: |delta| mean 0.04-0.055,
largest 0.25; reference best minus the engine's token up to 0.34. An FP8 KV cache (scale 1.0: 3
mantissa bits on every K and V) adds its own rounding: mean up to 0.066, largest 0.5. The bounds
are about twice those. What they catch (the same CPU run with a bug put in): one projection's
scales doubled or permuted, or a projection lost, move the largest by 1 to 3 nats; a 10% error in
one projection's scales stays within bf16's noise on this model, and is for the float32 tests to
find, where the engine and the reference round alike (the same greedy tokens here; logits within
5e-3 in tests/test_fp8.py).
"""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import transformers  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.kernels import compiled_variant_counts  # noqa: E402
from radixserve.model.layers.fp8 import (FP8_DTYPE, fp8_linear_reference, fp8_linear_scaled_mm,  # noqa: E402
                                         quantize_rows)
from radixserve.testing.fp8_checkpoint import write_fp8_checkpoint  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402
from test_fp8 import hf_fake_quant  # noqa: E402

MAX_NEW = 24
HOPPER_OR_ADA = torch.cuda.get_device_capability() >= (8, 9)
# Against the teacher-forced reference, in nats (see the module docstring): the largest |delta| of
# the engine's log probabilities and of the reference's best over the engine's token, and their means.
BF16_MAX_TOL, BF16_MEAN_TOL = 0.75, 0.12
FP8_KV_MAX_TOL, FP8_KV_MEAN_TOL = 1.0, 0.15
GIB = 1 << 30


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


def engine_logprobs(path, dtype: str, batch: list[list[int]], **settings
                    ) -> tuple[list[list[int]], list[list[float]], Engine]:
    """Greedy tokens and the log probability the engine reports for each."""
    settings.setdefault("cuda_graph_max_bs", 16)
    engine = Engine(str(path), device="cuda", dtype=dtype, max_total_tokens=8192, **settings)
    res = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0,
                                                            "ignore_eos": True, "return_logprob": True})
    engine.check_invariants()
    logprobs = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in res]
    return [r["output_ids"] for r in res], logprobs, engine


def hf_fp8_reference(dequantized: Path, slices: int = 1):
    """transformers' Qwen2 in float32 on the dequantized weights; each projection's input rounded to
    e4m3 per token (o_proj's and down_proj's per column block of `slices`, as tensor-parallel ranks
    see them), as the engine rounds it on every path: prefill and decode rows alike."""
    hf = transformers.Qwen2ForCausalLM.from_pretrained(dequantized, dtype=torch.float32).to("cuda").eval()

    def fake_quant(x: torch.Tensor) -> torch.Tensor:
        scale = (x.abs().amax(dim=-1, keepdim=True) * (1.0 / 448.0)).clamp_min(1e-12)  # as the engine
        return (x / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale

    def hook(args, parts: int):
        return (torch.cat([fake_quant(c) for c in args[0].chunk(parts, -1)], -1),)

    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            parts = slices if name.rpartition(".")[2] in ("o_proj", "down_proj") else 1
            module.register_forward_pre_hook(lambda _m, args, parts=parts: hook(args, parts))
    return hf


def check_teacher_forced(hf, batch: list[list[int]], tokens: list[list[int]], logprobs: list[list[float]], *,
                         max_tol: float, mean_tol: float) -> None:
    """The reference run over each prompt + the engine's tokens: at every generated position the
    engine's token is the reference's best within max_tol, and its log probability is the
    reference's within max_tol; both means within mean_tol."""
    gaps, deltas = [], []
    for prompt, out, lps in zip(batch, tokens, logprobs):
        assert len(out) == len(lps) == MAX_NEW
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out], device="cuda")).logits[0].float()
        rows = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).cpu()  # the rows predicting `out`
        chosen = rows[torch.arange(len(out)), torch.tensor(out)]
        gaps.append(rows.max(dim=-1).values - chosen)
        deltas.append((torch.tensor(lps, dtype=torch.float32) - chosen).abs())
    gap, delta = torch.cat(gaps), torch.cat(deltas)
    summary = (f"best - ours: max {float(gap.max()):.4f} mean {float(gap.mean()):.4f}; "
               f"|delta logprob|: max {float(delta.max()):.4f} mean {float(delta.mean()):.4f}")
    assert float(gap.max()) < max_tol and float(delta.max()) < max_tol, summary
    assert float(gap.mean()) < mean_tol and float(delta.mean()) < mean_tol, summary


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
    """bf16 with the Triton kernels (the FP8 decode-row GEMM for decode steps, cuBLASLt FP8 for the
    prefill): teacher-forced over the engine's greedy tokens, the float32 reference with the same
    activation rounding picks them and gives their log probabilities, within bf16's noise."""
    batch = prompts(6, 500, seed=11)
    tokens, logprobs, engine = engine_logprobs(fp8_ckpt.path, "bfloat16", batch)
    assert engine.core.model.kernels.triton and engine.core.runner.num_graph_steps > 0
    check_teacher_forced(hf_fp8_reference(fp8_ckpt.dequantized), batch, tokens, logprobs,
                         max_tol=BF16_MAX_TOL, mean_tol=BF16_MEAN_TOL)


def test_fp8_kv_cache_close_to_bf16_kv(fp8_ckpt):
    """An FP8 KV cache: teacher-forced over the engine's greedy tokens, the reference (whose K and V
    are unrounded, as a bf16 cache's are to within bf16) picks them and gives their log
    probabilities within the bf16 tolerance plus e4m3's rounding of K and V. The reference, not a
    bf16-KV engine: an engine fed the tokens as a prompt would sum them in the prefill GEMM's order,
    adding bf16 noise of its own to the comparison."""
    batch = prompts(6, 500, seed=12)
    tokens, logprobs, engine = engine_logprobs(fp8_ckpt.path, "bfloat16", batch, kv_cache_dtype="fp8_e4m3")
    assert engine.core.kv_pool.k_buffers[0].dtype == torch.float8_e4m3fn
    check_teacher_forced(hf_fp8_reference(fp8_ckpt.dequantized), batch, tokens, logprobs,
                         max_tol=FP8_KV_MAX_TOL, mean_tol=FP8_KV_MEAN_TOL)


def test_fp8_graphs_on_off_same_tokens(fp8_ckpt):
    batch = prompts(4, 500, seed=7)
    on, engine = engine_greedy(fp8_ckpt.path, "bfloat16", batch, kv_cache_dtype="fp8_e4m3")
    assert engine.core.runner.num_graph_steps > 0
    off, _ = engine_greedy(fp8_ckpt.path, "bfloat16", batch, kv_cache_dtype="fp8_e4m3", disable_cuda_graph=True)
    assert on == off


def test_fp8_kv_pool_holds_twice_the_tokens(fp8_ckpt, gpu_alone):
    """In the same bytes an FP8 pool holds twice the tokens, and each pool is what the budget leaves
    once the measured working set is taken out. mem_fraction_static counts all memory in use
    against the fraction, in this process too: the engines of earlier tests hold theirs until the
    garbage collector frees them (an engine's parts refer to each other). So each engine gets a
    fraction of 2 GiB over what is in use just before it starts: the same budget whatever the
    GPU's size and whatever ran before; other workers' tests wait (`gpu_alone`), their memory
    would move under the measurement. (The two working sets differ, so the token counts are not
    exactly 2:1; the bytes per token are.)"""
    sizes, pool_bytes, working_set, table_bytes = {}, {}, {}, {}
    for kv in ("auto", "fp8_e4m3"):
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        with Engine(str(fp8_ckpt.path), device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                    mem_fraction_static=(total - free + 2 * GIB) / total, skip_warmup=True,
                    disable_cuda_graph=True) as engine:
            sizes[kv] = engine.core.pool_size
            pool = engine.core.kv_pool
            pool_bytes[kv] = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
            plan = engine.core.memory_plan
            working_set[kv] = plan.activation_bytes + plan.graph_bytes
            table = engine.core.req_to_token.table
            table_bytes[kv] = table.numel() * table.element_size()
        del engine
    per_token = {kv: pool_bytes[kv] / sizes[kv] for kv in sizes}
    # The pool's few reserved slots make the ratio a hair off an exact 2.
    assert per_token["auto"] == pytest.approx(2 * per_token["fp8_e4m3"], rel=1e-4), per_token
    # Each pool is the budget, less the measured working set and what the engine allocates before it
    # sizes the pool: the request table (rows x context positions, int64)
    # and the tiny model's weights.
    assert all(0.95 * 2 * GIB < pool_bytes[kv] + working_set[kv] + table_bytes[kv] < 1.01 * 2 * GIB
               for kv in pool_bytes), (pool_bytes, working_set, table_bytes)


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
