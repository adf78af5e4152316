"""Gated DeltaNet's sequence mixing in torch: the reference every kernel is checked against.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) keeps, per sequence and value head, a state S of
[k_head_dim, v_head_dim] instead of a KV cache. Each token t, with its L2-normalised key k_t and
query q_t (scaled by 1/sqrt(k_head_dim)), its value v_t, a decay g_t <= 0 (log space) and a write
strength beta_t in (0, 1), does

    S <- exp(g_t) * S                      forget
    u_t = beta_t * (v_t - S^T k_t)         the delta rule: write only what S does not predict
    S <- S + k_t u_t^T
    o_t = S^T q_t

`recurrent_gated_delta_rule` runs exactly that, token by token (decode). `chunk_gated_delta_rule`
computes the same outputs and final state a chunk of C tokens at a time with matrix products
(prefill): within a chunk, with gamma_i the cumulative decay up to token i, the writes u solve a
unit lower-triangular system, (I + A) u = beta * v - beta * exp(gamma) * (K S0), A[i, j] =
beta_i exp(gamma_i - gamma_j) k_i.k_j for j < i; the outputs are exp(gamma) Q S0 plus the
causally decayed Q K^T times u; the state leaves the chunk as exp(gamma_C) S0 plus the decayed
K^T u. Both compute in float32 whatever the inputs' dtype.

Before it, the layer runs a short causal depthwise convolution over q|k|v channels (kernel 4):
`causal_conv1d` continues a sequence from the last `kernel - 1` inputs of its earlier part (its
conv state) and returns the window it ends with, so prefill chunks and decode steps chain.

Grouped value heads: value head h reads key/query head h // (num_v_heads // num_k_heads).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the form the published kernels use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) from the projections a, b [T, Hv]: g = -exp(A_log) * softplus(a + dt_bias) in
    float32 (log-space decay), beta = sigmoid(b) in b's dtype, as the published models compute them."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
    """[T, H, D] inputs -> float32 [Hv, T, D] (q, k normalised, q scaled, heads repeated per group),
    g and beta [Hv, T]."""
    group = v.shape[1] // k.shape[1]
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return (q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1), g.float().transpose(0, 1),
            beta.float().transpose(0, 1))


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences at once (a decode step): q, k [B, Hk, Dk], v [B, Hv, Dv],
    g, beta [B, Hv], state [B, Hv, Dk, Dv]. Returns (o [B, Hv, Dv] in v's dtype, the new states
    float32). The same arithmetic as `recurrent_gated_delta_rule`, without a host sync."""
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta)  # [Hv, B, D]: the batch where the tokens were
    s = state.float().transpose(0, 1) * gh.exp()[..., None, None]  # [Hv, B, Dk, Dv]
    u = bh[..., None] * (vh - torch.einsum("hbkv,hbk->hbv", s, kh))
    s = s + kh[..., :, None] * u[..., None, :]
    out = torch.einsum("hbkv,hbk->hbv", s, qh)
    return out.transpose(0, 1).to(v.dtype), s.transpose(0, 1)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: Optional[torch.Tensor] = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state
    [Hv, Dk, Dv] (None: zeros). Returns (o [T, Hv, Dv] in v's dtype, final state float32)."""
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta)
    hv, t, dk = kh.shape
    s = torch.zeros(hv, dk, vh.shape[-1], dtype=torch.float32, device=v.device) if state is None else state.float()
    out = torch.empty_like(vh)
    for i in range(t):
        s = s * gh[:, i].exp()[:, None, None]
        ki = kh[:, i]
        u = bh[:, i, None] * (vh[:, i] - torch.einsum("hkv,hk->hv", s, ki))
        s = s + ki[:, :, None] * u[:, None, :]
        out[:, i] = torch.einsum("hkv,hk->hv", s, qh[:, i])
    return out.transpose(0, 1).to(v.dtype), s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `recurrent_gated_delta_rule`, `chunk_size` tokens at a time (see the module
    docstring for the algebra)."""
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta)
    hv, t, dk = kh.shape
    dv = vh.shape[-1]
    s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    pad = -t % chunk_size
    if pad:  # padded tokens write nothing (beta 0) and forget nothing (g 0)
        qh, kh, vh = (F.pad(x, (0, 0, 0, pad)) for x in (qh, kh, vh))
        gh, bh = F.pad(gh, (0, pad)), F.pad(bh, (0, pad))
    n = (t + pad) // chunk_size
    qc, kc, vc = (x.view(hv, n, chunk_size, -1) for x in (qh, kh, vh))
    gamma = gh.view(hv, n, chunk_size).cumsum(-1)  # cumulative log decay inside each chunk
    bc = bh.view(hv, n, chunk_size)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    # exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal (masked before exp: no overflow).
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kk = kc @ kc.transpose(-1, -2)
    system = (bc[..., :, None] * kk * decay).tril(-1)  # A: strictly lower
    eye = torch.eye(chunk_size, dtype=torch.float32, device=v.device)
    rhs = torch.cat((bc[..., None] * vc, bc[..., None] * gamma.exp()[..., None] * kc), dim=-1)
    solved = torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., :dv], solved[..., dv:]  # u = u0 - w S0
    scores = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * gamma.exp()[..., None]
    k_to_end = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    out = torch.empty_like(vc)
    for c in range(n):
        u = u0[:, c] - w[:, c] @ s
        out[:, c] = q_decayed[:, c] @ s + scores[:, c] @ u
        s = s * gamma[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    out = out.reshape(hv, n * chunk_size, dv)[:, :t]
    return out.transpose(0, 1).to(v.dtype), s


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise convolution of one sequence's x [T, C] with weight [C, K],
    continuing from `state` [K - 1, C] (the inputs before x, oldest first; None: zeros). Returns
    (y [T, C] in x's dtype, the new state [K - 1, C]: the last K - 1 inputs)."""
    kernel = weight.shape[1]
    if state is None:
        state = x.new_zeros(kernel - 1, x.shape[1])
    window = torch.cat((state.to(x.dtype), x), dim=0)  # [K - 1 + T, C]
    y = F.conv1d(window.t()[None].to(weight.dtype), weight[:, None, :], groups=x.shape[1])[0].t()
    return F.silu(y).to(x.dtype), window[-(kernel - 1):].clone()
