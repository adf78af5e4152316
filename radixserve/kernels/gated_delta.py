"""Gated DeltaNet on Triton: the short causal convolution and the recurrent delta rule, each
reading and writing a request's state in place in the per-request state pool.

The math is radixserve.model.layers.gated_delta's (the torch reference these are tested
against). A ragged batch holds N sequences laid end to end (`cu_seqlens` [N + 1]); sequence i
continues the state in pool row `state_rows[i]` when `has_state[i]` is set (a later chunk of a
prompt, a decode step), else it starts from zeros (a new prompt). The pool's buffers are one
layer's: conv windows [rows, kernel - 1, channels] in the activations' dtype (the last inputs,
oldest first; channels contiguous so a program's loads coalesce), recurrent states
[rows, v_heads, k_head_dim, v_head_dim] in float32 (or bfloat16: --mamba-ssm-dtype; every kernel
computes in float32).

- `causal_conv1d_varlen`: the convolution of a ragged prefill batch, one program per tile of
  (sequence, BLOCK_T tokens) x BLOCK_C channels, the window before a sequence's first token read
  from its pool row; then `_conv_state_kernel` writes each sequence's last kernel - 1 inputs
  back (a second launch: the first must read every old window before any is replaced).
- `causal_conv1d_decode`: one token per sequence, the window shifted in place, one launch.
- `fused_recurrent_gated_delta_rule`: one program per (sequence, value head, BLOCK_V values of
  the state) keeps its [k_head_dim, BLOCK_V] slice of the state in registers over the
  sequence's tokens and writes it back once; the L2 norms of q and k, the query scale and the
  gates (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)) are computed inside. For
  decode that is the whole layer's recurrence in one launch that reads each state once; a long
  prompt walks its tokens one by one (the chunked kernels of radixserve.kernels.fla_gdn do
  prefill in parallel when flash-linear-attention is installed).

Decode launches depend only on the batch size: state rows, sequence starts and flags are read
from device memory, so a CUDA graph captured once replays for every step.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.launch import FastKernel

L2NORM_EPS = 1e-6



@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _conv_varlen_kernel(X, W, States, Out, state_rows, has_state, cu_seqlens, tile_seq, tile_start,
                        stride_xt, stride_ot, stride_sr, stride_sk, channels,
                        KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    tile = tl.program_id(0)
    cb = tl.program_id(1)
    i = tl.load(tile_seq + tile)
    t0 = tl.load(tile_start + tile)
    base = tl.load(cu_seqlens + i)
    length = tl.load(cu_seqlens + i + 1) - base
    row = tl.load(state_rows + i).to(tl.int64)
    cont = tl.load(has_state + i) != 0
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    mask_t = offs_t < length
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KW):
        p = offs_t - (KW - 1) + j  # the input position tap j reads (< 0: the window before the sequence)
        in_x = (p >= 0) & mask_t
        xv = tl.load(X + (base + p).to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
                     mask=in_x[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        in_state = (p < 0) & mask_t & cont
        sv = tl.load(States + row * stride_sr + (KW - 1 + p)[:, None] * stride_sk + offs_c[None, :],
                     mask=in_state[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + offs_c * KW + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    out_ptr = Out + (base + offs_t).to(tl.int64)[:, None] * stride_ot + offs_c[None, :]
    tl.store(out_ptr, _silu(acc).to(Out.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _conv_state_kernel(X, States, state_rows, has_state, cu_seqlens, stride_xt, stride_sr, stride_sk, channels,
                       KW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pool row <- the last KW - 1 inputs of (its old window, if continued) + the sequence."""
    i = tl.program_id(0)
    cb = tl.program_id(1)
    base = tl.load(cu_seqlens + i)
    length = tl.load(cu_seqlens + i + 1) - base
    row = tl.load(state_rows + i).to(tl.int64)
    cont = tl.load(has_state + i) != 0
    offs_j = tl.arange(0, BLOCK_K)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_j < KW - 1)[:, None] & (offs_c < channels)[None, :]
    p = length - (KW - 1) + offs_j
    xv = tl.load(X + (base + p).to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
                 mask=mask & (p >= 0)[:, None], other=0.0)
    state_ptr = States + row * stride_sr + offs_c[None, :]
    old = tl.load(state_ptr + (KW - 1 + p)[:, None] * stride_sk, mask=mask & (p < 0)[:, None] & cont, other=0.0)
    window = tl.where((p >= 0)[:, None], xv.to(States.dtype.element_ty), old)
    tl.store(state_ptr + offs_j[:, None] * stride_sk, window, mask=mask)


@triton.jit
def _conv_decode_kernel(X, W, States, Out, state_rows, has_state, stride_xt, stride_ot, stride_sr, stride_sk,
                        channels, KW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    cb = tl.program_id(1)
    row = tl.load(state_rows + b).to(tl.int64)
    cont = tl.load(has_state + b) != 0
    offs_j = tl.arange(0, BLOCK_K)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    mask = (offs_j < KW - 1)[:, None] & mask_c[None, :]
    state_ptr = States + row * stride_sr + offs_c[None, :]
    window = tl.load(state_ptr + offs_j[:, None] * stride_sk, mask=mask & cont, other=0.0)
    x = tl.load(X + b * stride_xt + offs_c, mask=mask_c, other=0.0)
    w_old = tl.load(W + offs_c[None, :] * KW + offs_j[:, None], mask=mask, other=0.0).to(tl.float32)
    w_new = tl.load(W + offs_c * KW + (KW - 1), mask=mask_c, other=0.0).to(tl.float32)
    acc = tl.sum(window.to(tl.float32) * w_old, 0) + x.to(tl.float32) * w_new
    tl.store(Out + b * stride_ot + offs_c, _silu(acc).to(Out.dtype.element_ty), mask=mask_c)
    # The window moves on by one: row j takes row j + 1, the last row takes x.
    shifted = tl.load(state_ptr + (offs_j + 1)[:, None] * stride_sk, mask=mask & (offs_j < KW - 2)[:, None] & cont,
                      other=0.0)
    new = tl.where((offs_j == KW - 2)[:, None], x[None, :].to(States.dtype.element_ty), shifted)
    tl.store(state_ptr + offs_j[:, None] * stride_sk, new, mask=mask)


@triton.jit
def _recurrent_kernel(Q, K, V, A, B, A_log, dt_bias, States, O, state_rows, has_state, cu_seqlens,
                      stride_qt, stride_kt, stride_vt, stride_at, stride_bt, stride_ot,
                      stride_sr, stride_sh, stride_sk, scale, eps,
                      GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    # int64 bounds: the loop's token index then is one, and so are its offsets.
    start = tl.load(cu_seqlens + i).to(tl.int64)
    end = tl.load(cu_seqlens + i + 1).to(tl.int64)
    row = tl.load(state_rows + i).to(tl.int64)
    cont = tl.load(has_state + i) != 0
    hk = h // GROUP
    offs_k = tl.arange(0, DK)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < DV
    s_ptr = States + row * stride_sr + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s = tl.load(s_ptr, mask=mask_v[None, :] & cont, other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(A_log + h).to(tl.float32))
    bias = tl.load(dt_bias + h).to(tl.float32)
    for t64 in range(start, end):
        q = tl.load(Q + t64 * stride_qt + hk * DK + offs_k).to(tl.float32)
        k = tl.load(K + t64 * stride_kt + hk * DK + offs_k).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        v = tl.load(V + t64 * stride_vt + h * DV + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        x = tl.load(A + t64 * stride_at + h).to(tl.float32) + bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        b_raw = tl.load(B + t64 * stride_bt + h)
        # beta rounded to b's dtype, as the models compute sigmoid(b) in it.
        beta = (1.0 / (1.0 + tl.exp(-b_raw.to(tl.float32)))).to(b_raw.dtype).to(tl.float32)
        s = s * tl.exp(neg_a * softplus)
        u = beta * (v - tl.sum(s * k[:, None], 0))
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(O + t64 * stride_ot + h * DV + offs_v, o.to(O.dtype.element_ty), mask=mask_v)
    tl.store(s_ptr, s.to(States.dtype.element_ty), mask=mask_v[None, :])


_conv_varlen = FastKernel(_conv_varlen_kernel)
_conv_state = FastKernel(_conv_state_kernel)
_conv_decode = FastKernel(_conv_decode_kernel)
_recurrent = FastKernel(_recurrent_kernel)

CONV_BLOCK_T = 64
CONV_BLOCK_C = 128


def conv_tiles(extend_lens: list[int], block_t: int = CONV_BLOCK_T) -> tuple[list[int], list[int]]:
    """The (sequence, first token) of every BLOCK_T-token tile of a ragged batch (host lists)."""
    seqs, starts = [], []
    for i, n in enumerate(extend_lens):
        for t0 in range(0, n, block_t):
            seqs.append(i)
            starts.append(t0)
    return seqs, starts


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, state_rows: torch.Tensor,
                         has_state: torch.Tensor, cu_seqlens: torch.Tensor, tile_seq: torch.Tensor,
                         tile_start: torch.Tensor, out: Optional[torch.Tensor] = None,
                         block_t: int = CONV_BLOCK_T) -> torch.Tensor:
    """SiLU(causal depthwise conv) of a ragged batch x [T, C] (rows of unit stride; a view into a
    wider projection is fine) with weight [C, K]; states [rows, K - 1, C] is read for sequences
    with has_state and then holds every sequence's new window. tile_seq / tile_start: the
    device copy of `conv_tiles(extend_lens, block_t)`. Returns out [T, C] (new unless given)."""
    t, channels = x.shape
    kernel = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and states.stride(2) == 1 and kernel >= 2
    if out is None:
        out = torch.empty((t, channels), dtype=x.dtype, device=x.device)
    num_seqs = cu_seqlens.numel() - 1
    if t == 0 or num_seqs == 0:
        return out
    cblocks = triton.cdiv(channels, CONV_BLOCK_C)
    _conv_varlen[(tile_seq.numel(), cblocks)](x, weight, states, out, state_rows, has_state, cu_seqlens, tile_seq,
                                             tile_start, x.stride(0), out.stride(0), states.stride(0),
                                             states.stride(1), channels, KW=kernel, BLOCK_T=block_t,
                                             BLOCK_C=CONV_BLOCK_C, num_warps=4)
    _conv_state[(num_seqs, cblocks)](x, states, state_rows, has_state, cu_seqlens, x.stride(0), states.stride(0),
                                     states.stride(1), channels, KW=kernel,
                                     BLOCK_K=max(2, triton.next_power_of_2(kernel - 1)), BLOCK_C=CONV_BLOCK_C,
                                     num_warps=4)
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, state_rows: torch.Tensor,
                         has_state: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per sequence: x [B, C]; the window of pool row state_rows[b] (zeros unless
    has_state[b]) moves on by x[b] in place. Returns out [B, C]."""
    bs, channels = x.shape
    kernel = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and states.stride(2) == 1 and kernel >= 2
    if out is None:
        out = torch.empty((bs, channels), dtype=x.dtype, device=x.device)
    if bs:
        _conv_decode[(bs, triton.cdiv(channels, CONV_BLOCK_C))](
            x, weight, states, out, state_rows, has_state, x.stride(0), out.stride(0), states.stride(0),
            states.stride(1), channels, KW=kernel, BLOCK_K=max(2, triton.next_power_of_2(kernel - 1)),
            BLOCK_C=CONV_BLOCK_C, num_warps=4)
    return out


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                     b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                                     states: torch.Tensor, state_rows: torch.Tensor, has_state: torch.Tensor,
                                     cu_seqlens: torch.Tensor, out: Optional[torch.Tensor] = None,
                                     block_v: int = 32) -> torch.Tensor:
    """The gated delta rule over a ragged batch, each sequence's state updated in place in
    states [rows, Hv, Dk, Dv] (float32, or bfloat16: computed in float32, rounded once per call)
    at state_rows (zeros first unless has_state).

    q, k [T, Hk, Dk] and v [T, Hv, Dv] may be strided views (unit last stride, heads packed);
    a, b [T, Hv] the gate projections (views fine); a_log, dt_bias [Hv]. Returns o [T, Hv, Dv]
    in v's dtype."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape and hv % hk == 0 and dk & (dk - 1) == 0, "k_head_dim must be a power of two"
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and q.stride(1) == dk and v.stride(1) == dv
    assert a.stride(1) == 1 and b.stride(1) == 1 and states.is_contiguous()
    if out is None:
        out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    num_seqs = cu_seqlens.numel() - 1
    if t == 0 or num_seqs == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(dv))
    _recurrent[(num_seqs, hv, triton.cdiv(dv, block_v))](
        q, k, v, a, b, a_log, dt_bias, states, out, state_rows, has_state, cu_seqlens,
        q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), out.stride(0),
        states.stride(0), states.stride(1), states.stride(2), dk ** -0.5, L2NORM_EPS,
        GROUP=hv // hk, DK=dk, DV=dv, BLOCK_V=block_v, num_warps=4 if dk * block_v >= 4096 else 1)
    return out
