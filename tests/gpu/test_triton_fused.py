"""Fused Triton kernels (RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE) against torch on random inputs.

Runs on a CUDA GPU; skipped elsewhere (TRITON_INTERPRET=1 runs it on the CPU in fp16/fp32).
"""

from __future__ import annotations

import pytest
import torch

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.kernels.activation import silu_and_mul  # noqa: E402
from radixserve.kernels.norm import add_rms_norm, rms_norm  # noqa: E402
from radixserve.kernels.rope import apply_rope_  # noqa: E402

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16
DTYPES = [LOW, torch.float32]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 896), (7, 3584), (300, 896), (1, 64)])
def test_rms_norm(rows, hidden, dtype):
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype) * 3
    w = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    out = rms_norm(x, w, 1e-6)
    ref = hf_rms_norm(x, w, 1e-6)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 3584), (129, 896)])
def test_add_rms_norm(rows, hidden, dtype):
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    w = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    summed = x + residual
    ref = hf_rms_norm(summed, w, 1e-6)
    out, res = add_rms_norm(x, residual, w, 1e-6)
    assert res.data_ptr() == residual.data_ptr()
    assert torch.equal(res, summed)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 18944), (33, 4864), (5, 100)])
def test_silu_and_mul(rows, inter, dtype):
    x = torch.randn(rows, 2 * inter, device=DEVICE).to(dtype)
    out = torch.full((rows, inter), float("nan"), dtype=dtype, device=DEVICE)
    silu_and_mul(x, out=out)
    gate, up = x.float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < tol(dtype)


def rope_tables(max_pos: int, head_dim: int, theta: float):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = torch.arange(max_pos, device=DEVICE).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,head_dim", [(1, 28, 4, 128), (77, 14, 2, 64), (5, 4, 2, 64)])
def test_rope(tokens, hq, hkv, head_dim, dtype):
    cos, sin = rope_tables(9000, head_dim, 1e6)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    positions = torch.randint(0, 9000, (tokens,), device=DEVICE)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    q_ref = q.float() * c + rot(q.float()) * s
    k_ref = k.float() * c + rot(k.float()) * s
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    apply_rope_(q, k, positions, cos.to(dtype), sin.to(dtype))
    assert rel_err(q, q_ref) < tol(dtype) * (1 if dtype != torch.float32 else 10)
    assert rel_err(k, k_ref) < tol(dtype) * (1 if dtype != torch.float32 else 10)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], v_before)


@pytest.mark.parametrize("pool_dtype", [None, torch.float32])
@pytest.mark.parametrize("tokens,hq,hkv,head_dim", [(1, 28, 4, 128), (77, 14, 2, 64)])
def test_rope_and_store_kv(tokens, hq, hkv, head_dim, pool_dtype):
    """The fused RoPE + KV store: q and k rotated in place exactly as without the store, the pool
    holds the rotated k and the untouched v at each token's slot, and no other slot changes."""
    dtype = LOW
    pool_dtype = pool_dtype or dtype
    cos, sin = rope_tables(9000, head_dim, 1e6)
    cos, sin = cos.to(dtype), sin.to(dtype)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim:].view(tokens, hkv, head_dim)
    positions = torch.randint(0, 9000, (tokens,), device=DEVICE)
    num_slots = 3 * tokens + 5
    loc = torch.randperm(num_slots, device=DEVICE)[:tokens]
    k_buf = torch.full((num_slots, hkv, head_dim), float("nan"), device=DEVICE).to(pool_dtype)
    v_buf = torch.full((num_slots, hkv, head_dim), float("nan"), device=DEVICE).to(pool_dtype)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rope_(q_ref, k_ref, positions, cos, sin)
    v_before = v.clone()

    apply_rope_(q, k, positions, cos, sin, v=v, k_buf=k_buf, v_buf=v_buf, loc=loc)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(v, v_before)
    assert torch.equal(k_buf[loc], k_ref.to(pool_dtype))
    assert torch.equal(v_buf[loc], v_before.to(pool_dtype))
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.isnan(k_buf[untouched]).all() and torch.isnan(v_buf[untouched]).all()
    with pytest.raises(ValueError):
        apply_rope_(q, k, positions, cos, sin, k_buf=k_buf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,head_dim", [(1, 32, 8, 128), (37, 16, 8, 128), (5, 4, 2, 32)])
def test_rope_with_qk_norm(tokens, hq, hkv, head_dim, dtype):
    """Qwen3's per-head q/k RMSNorm inside the RoPE launch, on views into a fused qkv (Qwen3-8B's
    and Qwen3-0.6B's heads): what the RMSNorm kernel on [tokens * heads, head_dim] rows and then
    RoPE give (float32 summation order aside), and transformers' order of operations; k stored in
    the pool normed and rotated, v untouched."""
    cos, sin = rope_tables(9000, head_dim, 1e6)
    cos, sin = cos.to(dtype), sin.to(dtype)
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * head_dim, device=DEVICE) * 3).to(dtype)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim:].view(tokens, hkv, head_dim)
    qw = (torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype)
    kw = (torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype)
    positions = torch.randint(0, 9000, (tokens,), device=DEVICE)
    # Unfused: the norm kernel on rows, then RoPE on the new tensors.
    q_ref = rms_norm(q.reshape(-1, head_dim), qw, 1e-6).view(tokens, hq, head_dim)
    k_ref = rms_norm(k.reshape(-1, head_dim), kw, 1e-6).view(tokens, hkv, head_dim)
    c, s = cos[positions][:, None, :].float(), sin[positions][:, None, :].float()

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    q_hf = hf_rms_norm(q, qw, 1e-6).float() * c + rot(hf_rms_norm(q, qw, 1e-6).float()) * s
    k_hf = hf_rms_norm(k, kw, 1e-6).float() * c + rot(hf_rms_norm(k, kw, 1e-6).float()) * s
    apply_rope_(q_ref, k_ref, positions, cos, sin)
    v_before = v.clone()
    num_slots = 2 * tokens + 3
    loc = torch.randperm(num_slots, device=DEVICE)[:tokens]
    k_buf = torch.full((num_slots, hkv, head_dim), float("nan"), device=DEVICE).to(dtype)
    v_buf = torch.full((num_slots, hkv, head_dim), float("nan"), device=DEVICE).to(dtype)
    apply_rope_(q, k, positions, cos, sin, v=v, k_buf=k_buf, v_buf=v_buf, loc=loc, q_norm_weight=qw,
                k_norm_weight=kw, eps=1e-6)
    close = 1e-5 if dtype == torch.float32 else 1e-3  # measured: 4e-8 and 4e-6 (fp16, the interpreter)
    assert rel_err(q, q_ref) < close and rel_err(k, k_ref) < close
    assert rel_err(q, q_hf) < 10 * tol(dtype) and rel_err(k, k_hf) < 10 * tol(dtype)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v_before) and torch.equal(v, v_before)
    with pytest.raises(ValueError, match="both"):
        apply_rope_(q, k, positions, cos, sin, q_norm_weight=qw)


@pytest.mark.skipif(DEVICE != "cuda", reason="the direct launch path exists on CUDA only")
def test_direct_launch_matches_triton_for_every_specialisation():
    """FastKernel calls a compiled kernel's launcher directly after the first call of each
    specialisation: misaligned views and an int equal to 1 must get their own variants."""
    from radixserve.kernels import norm

    torch.manual_seed(0)
    flat = torch.randn(64 * 896 + 1, device="cuda").to(torch.bfloat16)
    w = (torch.rand(896, device="cuda") + 0.5).to(torch.bfloat16)
    aligned = flat[:64 * 896].view(64, 896)
    misaligned = flat[1:].view(64, 896)  # 2 bytes off: not 16-byte aligned
    one_col = torch.randn(5, 1, device="cuda").to(torch.bfloat16)  # n_cols == 1
    w1 = torch.ones(1, device="cuda", dtype=torch.bfloat16)
    for x, weight in [(aligned, w), (misaligned, w), (one_col, w1), (aligned, w), (misaligned, w), (one_col, w1)]:
        for _ in range(2):  # the second call of each takes the direct path
            out = rms_norm(x, weight, 1e-6)
            assert rel_err(out, hf_rms_norm(x, weight, 1e-6)) < 1e-2
    assert len(norm._rms_norm._cache) >= 3, "each specialisation has its own entry"
