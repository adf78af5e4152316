"""The model's Triton layers against its torch layers, on the tiny Qwen2 and Qwen3 over the Triton
attention backend: close logits and the same KV in the pool, for an extend of more rows than the decode-row
GEMM takes (cuBLAS), one of fewer (the decode-row GEMM, SiLU fused), and a decode step after each.
With the Triton layers RoPE stores K and V itself; with the torch layers the backend does.

Runs on a CUDA GPU; skipped elsewhere (TRITON_INTERPRET=1 runs it on the CPU in fp16).
"""

from __future__ import annotations

import random
from typing import Optional

import pytest
import torch

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.attention.base import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec  # noqa: E402
from radixserve.model.layers import KernelChoice  # noqa: E402
from radixserve.model.loader import load_model  # noqa: E402
from radixserve.model.qwen2 import Qwen2ForCausalLM  # noqa: E402
from radixserve.model.registry import model_class  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16
MAX_ROWS = 32


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def extend_then_decode(model: Qwen2ForCausalLM, prompts: list[list[int]], kv_dtype: Optional[torch.dtype] = None
                       ) -> tuple[list[torch.Tensor], KVPool]:
    """All but the last token of every prompt in one extend batch, then the last ones in one decode
    step; the logits of both and the pool (of `kv_dtype`, default the activations')."""
    cfg = model.config
    pool = KVPool(1024, 1, cfg.num_kv_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype or LOW, DEVICE)
    ext = [len(p) - 1 for p in prompts]
    n = len(prompts)
    if getattr(model, "recurrent_state_shape", None) is not None:  # a hybrid's per-request states
        pool.state = RecurrentStatePool(n, RecurrentStateSpec(**model.recurrent_state_shape), DEVICE)
    req_to_token = torch.zeros((n, max(ext) + 1), dtype=torch.int64, device=DEVICE)
    slot = 1
    for i, e in enumerate(ext):
        req_to_token[i, :e + 1] = torch.arange(slot, slot + e + 1)
        slot += e + 1

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    rows = list(range(n))
    ends = [sum(ext[:i + 1]) - 1 for i in rows]
    extend = ForwardBatch(ForwardMode.EXTEND, t([tok for p in prompts for tok in p[:-1]]),
                          torch.cat([torch.arange(e, device=DEVICE) for e in ext]),
                          torch.cat([req_to_token[i, :e] for i, e in enumerate(ext)]), t(rows), t(ext), t(ext),
                          t([0] * n), list(ext), list(ext), [0] * n, req_to_token, pool, logits_indices=t(ends))
    seq = [e + 1 for e in ext]
    decode = ForwardBatch(ForwardMode.DECODE, t([p[-1] for p in prompts]), t(ext),
                          t([int(req_to_token[i, e]) for i, e in enumerate(ext)]), t(rows), t(seq), t([1] * n),
                          t(ext), seq, [1] * n, list(ext), req_to_token, pool, logits_indices=t(rows))
    return [model(extend), model(decode)], pool


def triton_and_torch_models(path) -> dict[bool, Qwen2ForCausalLM]:
    """{True: the Triton layers, False: the torch layers}, same weights, each on its own backend."""
    num_sms = None if DEVICE == "cuda" else 8  # the interpreter has no device to ask
    reference, _ = load_model(path, dtype=LOW, device=DEVICE, attn_backend=TritonAttentionBackend(num_sms=num_sms),
                              triton_kernels=False)
    # KernelChoice.for_device refuses the Triton kernels off CUDA; under the interpreter they run
    # on the CPU, so the choice is made here and the reference's weights copied in.
    model = model_class(reference.config.architecture)(
        reference.config, TritonAttentionBackend(num_sms=num_sms), dtype=LOW, device=DEVICE,
        kernels=KernelChoice(triton=True, decode_gemm_max_rows=MAX_ROWS))
    model.load_state_dict(reference.state_dict())
    return {True: model.eval(), False: reference}


def fp32_twin(model: Qwen2ForCausalLM, path, **load) -> Qwen2ForCausalLM:
    """The torch layers in float32 holding `model`'s (rounded) weights: the truth both low-precision
    paths are measured against."""
    num_sms = None if DEVICE == "cuda" else 8
    twin, _ = load_model(path, dtype=torch.float32, device=DEVICE, attn_backend=TritonAttentionBackend(num_sms=num_sms),
                         triton_kernels=False, **load)
    with torch.no_grad():
        for ours, theirs in zip(twin.parameters(), model.parameters(), strict=True):
            ours.copy_(theirs)
    return twin.eval()


def within_low_precision_noise(ours: torch.Tensor, reference: torch.Tensor, truth: torch.Tensor) -> bool:
    """Whether `ours` (the Triton layers) is no farther from the float32 truth than the reference's
    own rounding, give or take: on the tiny random hybrids bf16 rounding alone puts the torch layers
    2-15% away from float32 (measured on an H200), so the two low-precision paths are compared to the
    truth rather than to each other."""
    return rel_err(ours, truth) < max(2e-2, 2.5 * rel_err(reference, truth))


# (build_tiny_model arguments, prompt lengths): the extend batch (all tokens but the last of each)
# has more rows than the decode-row GEMM takes, or fewer; lm_head (tied: the embedding) takes it
# for the few sampled rows. Qwen3: the q/k norms inside the RoPE kernel (the torch layers: RMSNorm
# on [tokens * heads, head_dim] rows, then RoPE); heads x head_dim (128) wider than hidden (64).
CASES = {"untied-cublas-rows": (dict(tie_word_embeddings=False), (20, 17)),
         "tied-decode-gemm-rows": (dict(tie_word_embeddings=True), (4, 9, 6)),
         "qwen3-wide-heads-cublas-rows": (dict(family="qwen3", head_dim=32, tie_word_embeddings=False), (20, 17)),
         "qwen3-wide-heads-decode-gemm-rows": (dict(family="qwen3", head_dim=32, tie_word_embeddings=True), (4, 9, 6))}


@pytest.mark.parametrize("case", CASES)
def test_triton_layers_match_torch_layers(case, tmp_path):
    build, lengths = CASES[case]
    tied = build["tie_word_embeddings"]
    assert (sum(lengths) - len(lengths) > MAX_ROWS) == ("cublas" in case)
    models = triton_and_torch_models(build_tiny_model(tmp_path / "tiny", **build))
    assert type(models[True]) is type(models[False])
    assert (models[True].lm_head.weight is models[True].model.embed_tokens.weight) == tied
    rng = random.Random(sum(lengths))
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    (ext_t, dec_t), pool_t = extend_then_decode(models[True], prompts)
    (ext_r, dec_r), pool_r = extend_then_decode(models[False], prompts)
    assert rel_err(ext_t, ext_r) < 2e-2 and rel_err(dec_t, dec_r) < 2e-2
    assert torch.isfinite(ext_t).all() and torch.isfinite(dec_t).all()
    used = slice(1, 1 + sum(lengths))  # slot 0 is the pool's reserved slot
    for layer in range(len(pool_t.k_buffers)):
        assert rel_err(pool_t.k_buffers[layer][used], pool_r.k_buffers[layer][used]) < 1e-2
        assert rel_err(pool_t.v_buffers[layer][used], pool_r.v_buffers[layer][used]) < 1e-2


# The hybrids: Gated DeltaNet (the conv and recurrent kernels; fla's chunked one where installed
# and a prompt is 64 tokens or longer) and gated attention (head_dim 32 here) against the torch layers.
HYBRID_CASES = {"qwen3_5-decode-gemm-rows": (dict(family="qwen3_5"), (4, 9, 6)),
                "qwen3_next-cublas-rows": (dict(family="qwen3_next"), (20, 17)),
                "qwen3_5-long-prompt": (dict(family="qwen3_5"), (70, 3)),
                # The fused MoE in every layer, with the shared expert.
                "qwen3_5_moe-cublas-rows": (dict(family="qwen3_5_moe"), (20, 17))}


@pytest.mark.parametrize("case", HYBRID_CASES)
def test_hybrid_triton_layers_match_torch_layers(case, tmp_path):
    build, lengths = HYBRID_CASES[case]
    path = build_tiny_model(tmp_path / "tiny", layers=4, head_dim=32, **build)
    models = triton_and_torch_models(path)
    rng = random.Random(sum(lengths))
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    (ext_t, dec_t), pool_t = extend_then_decode(models[True], prompts)
    (ext_r, dec_r), pool_r = extend_then_decode(models[False], prompts)
    (ext_f, dec_f), pool_f = extend_then_decode(fp32_twin(models[False], path), prompts, kv_dtype=torch.float32)
    assert torch.isfinite(ext_t).all() and torch.isfinite(dec_t).all()
    assert within_low_precision_noise(ext_t, ext_r, ext_f) and within_low_precision_noise(dec_t, dec_r, dec_f)
    # The states too, against the float32 twin's: a layer's conv state holds its input projection,
    # which carries every earlier layer's bf16 rounding (the two bf16 paths differ 2-6% there on an
    # H100, as the hidden states do), so they are held to the truth rather than to each other.
    rows = slice(0, len(lengths))  # the scratch row past them is the padding's
    for layer in range(len(pool_t.state.conv)):
        for kind in ("conv", "ssm"):
            ours, ref, truth = (getattr(p.state, kind)[layer][rows] for p in (pool_t, pool_r, pool_f))
            assert within_low_precision_noise(ours, ref, truth), (kind, layer, rel_err(ours, truth),
                                                                  rel_err(ref, truth))
