"""Mixture-of-experts MLP on the GPU: the router's top-k, then every expert's gate|up, SiLU, down
and the weighted sum over the top-k, in six launches whatever the number of experts.

1. `topk_softmax`: per token, softmax over the router logits in float32, the top-k experts and
   their probabilities (renormalised to sum to 1 with `renormalize`), as transformers' router.
2. `moe_align`: the (token, expert) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M, so that every BLOCK_M rows of the sorted list belong to one expert:
   `sorted_ids` (the pair index t * top_k + j, or the sentinel `slots` in padding), `expert_ids`
   (the expert of each BLOCK_M rows) and the padded total. Two kernels: one program counts the
   pairs per expert and lays out the runs (and fills the padding), then every pair takes the next
   place in its expert's run with an atomic. Where a pair lands inside its run changes no result
   (each GEMM row is computed on its own), so the outputs do not depend on the atomics' order.
3. `moe_gemm` over the gate|up weights [E, 2I, H]: each program multiplies one BLOCK_M run of
   rows (the tokens' hidden states, gathered through `sorted_ids`) by one expert's BLOCK_N
   weight rows: half gate rows, half the up rows of the same columns, so its epilogue writes
   silu(gate) * up [pairs, I] and the [pairs, 2I] intermediate never exists.
4. `moe_gemm` over the down weights [E, H, I], the routing weight of each pair applied in the
   epilogue: [pairs, H].
5. `topk_sum`: each token's top-k rows added in float32, in top-k order.

Every shape is fixed by the number of tokens (the grids cover the most padded rows any routing
can give, `max_padded_rows`; programs past the real total return at once), nothing is read back
to the host, so a decode step's MoE replays inside its CUDA graph. float32 activations multiply
in IEEE float32 (not TF32), so a float32 model matches its reference on the GPU too.

FP8 experts (e4m3 weights) are read as one byte and widened to the activation dtype in registers
(weight-only FP8: the activations stay bf16); the weight's scales are applied per output channel
in the epilogue ([E, N] scales), or per block ([E, N/bn, K/bk] `weight_scale_inv`, BLOCK_K
dividing bk) on each K tile's partial product.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.fused_moe_config import (FusedMoeConfig, block_k_fits_scale_blocks, max_padded_rows,
                                                 pipeline_stages)
from radixserve.kernels.launch import FastKernel

# Pairs each program of the alignment's counting loop reads per iteration, and its fill block.
ALIGN_CHUNK = 1024
# Blocks whose expert the layout program resolves per iteration.
ALIGN_BLOCKS = 64


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_kernel(Logits, Weights, Ids, num_tokens, num_experts, stride_l,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, E_P2: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, E_P2)
    mask = offs < num_experts
    x = tl.load(Logits + row.to(tl.int64) * stride_l + offs, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, 0)
    e = tl.where(mask, tl.exp(x), 0.0)
    p = e / tl.sum(e, 0)
    p = tl.where(mask, p, -1.0)
    picked = tl.zeros((E_P2,), dtype=tl.float32)
    total = 0.0
    # k rounds of argmax (the lowest index among equals, as torch.topk keeps the first): k and E are small.
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, E_P2), 0)
        tl.store(Ids + row * TOP_K + j, idx.to(Ids.dtype.element_ty))
        picked = tl.where(offs == j, best, picked)
        total += best
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        picked = picked / total
    tl.store(Weights + row * TOP_K + offs, picked.to(Weights.dtype.element_ty), mask=offs < TOP_K)


@triton.jit(do_not_specialize=["slots", "max_padded"])
def _align_layout_kernel(TopkIds, SortedIds, ExpertIds, Cursor, NumPostPadded, slots, num_experts, max_padded,
                         max_blocks, BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    if pid > 0:  # the other programs fill the padding's sentinel
        offs = (pid - 1) * CHUNK + tl.arange(0, CHUNK)
        tl.store(SortedIds + offs, slots, mask=offs < max_padded)
        return
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for start in range(0, slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        # Lanes past the pairs count into bin E_P2 - 1, which no expert uses (E_P2 > num_experts).
        ids = tl.load(TopkIds + offs, mask=offs < slots, other=E_P2 - 1).to(tl.int32)
        counts += tl.histogram(ids, E_P2)
    experts = tl.arange(0, E_P2)
    counts = tl.where(experts < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(Cursor + experts, starts, mask=experts < num_experts)
    tl.store(NumPostPadded, tl.sum(padded, 0))
    # Block b belongs to the first expert whose run ends past row b * BLOCK_M (empty runs skipped).
    for b0 in range(0, max_blocks, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        past = (ends[None, :] <= blocks[:, None] * BLOCK_M) & (experts[None, :] < num_experts)
        owner = tl.sum(past.to(tl.int32), 1)
        tl.store(ExpertIds + blocks, tl.minimum(owner, num_experts - 1), mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["slots"])
def _align_scatter_kernel(TopkIds, SortedIds, Cursor, slots, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < slots
    expert = tl.load(TopkIds + offs, mask=mask, other=0).to(tl.int32)
    place = tl.atomic_add(Cursor + expert, 1, mask=mask)
    tl.store(SortedIds + place, offs, mask=mask)


@triton.jit
def _silu_mul(gate, up, DTYPE: tl.constexpr):
    # Rounded to the activation dtype first, as an unfused GEMM then silu_and_mul would.
    gate = gate.to(DTYPE).to(tl.float32)
    up = up.to(DTYPE).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit(do_not_specialize=["slots", "num_pid_m"])
def _moe_gemm_kernel(
    A, W, C, WScale, RoutedWeights, SortedIds, ExpertIds, NumPostPadded,
    N, K, slots, num_pid_m, stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_sn, stride_sk,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED: tl.constexpr, SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # SCALE: 0 plain weights; 1 FP8 with one scale per output row ([E, N]); 2 FP8 with one scale
    # per SCALE_BN x SCALE_BK block ([E, N / SCALE_BN, K / SCALE_BK]).
    pid = tl.program_id(0)
    n_out = N // 2 if GATED else N
    cols_per_tile: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    num_pid_n = tl.cdiv(n_out, cols_per_tile)
    # Grouped order: GROUP_M consecutive M tiles walk the N tiles together (weight tiles stay in L2).
    per_group = GROUP_M * num_pid_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(NumPostPadded):
        return
    offs_row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_row)
    valid = pair < slots
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    r = tl.arange(0, BLOCK_N)
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        cols = pid_n * HALF + (r % HALF)
        offs_n = tl.where(r < HALF, cols, n_out + cols)
        mask_n = cols < n_out
    else:
        offs_n = pid_n * BLOCK_N + r
        mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (pair // ROWS_PER_A).to(tl.int64)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if SCALE == 0:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        elif SCALE == 1:
            acc = tl.dot(a, w.to(A.dtype.element_ty), acc)  # e4m3 widens exactly to bf16/fp16
        else:
            s_ptrs = WScale + expert * stride_se + (offs_n // SCALE_BN) * stride_sn + \
                (kt * BLOCK_K // SCALE_BK) * stride_sk
            s = tl.load(s_ptrs, mask=mask_n, other=0.0)
            acc += tl.dot(a, w.to(A.dtype.element_ty)) * s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALE == 1:
        acc *= tl.load(WScale + expert * stride_se + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
    if MUL_ROUTED:
        acc *= tl.load(RoutedWeights + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ty = C.dtype.element_ty
    c_rows = pair.to(tl.int64)[:, None] * stride_cm
    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        h = _silu_mul(gate, up, out_ty)
        out_cols = pid_n * HALF + tl.arange(0, HALF)
        tl.store(C + c_rows + out_cols[None, :], h.to(out_ty), mask=valid[:, None] & (out_cols < n_out)[None, :])
    else:
        tl.store(C + c_rows + offs_n[None, :], acc.to(out_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_sum_kernel(Y, Out, num_tokens, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # top-k order: the sum does not depend on timing
        acc += tl.load(Y + (token * TOP_K + j) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + token * hidden + offs, acc.to(Out.dtype.element_ty), mask=mask)


_topk = FastKernel(_topk_softmax_kernel)
_sum = FastKernel(_topk_sum_kernel)
_layout = FastKernel(_align_layout_kernel)
_scatter = FastKernel(_align_scatter_kernel)
_gemm = FastKernel(_moe_gemm_kernel)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 weight_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in `weight_dtype` (default the logits'), expert ids [T, top_k] int32),
    highest probability first: softmax in float32, the top-k, renormalised if asked."""
    t, e = logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"topk_softmax: top_k={top_k} of {e} experts")
    weights = torch.empty((t, top_k), dtype=weight_dtype or logits.dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t:
        e_p2 = max(16, triton.next_power_of_2(e))
        _topk[(t,)](logits, weights, ids, t, e, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, E_P2=e_p2,
                    num_warps=1 if e_p2 <= 128 else 4)
    return weights, ids


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_padded] int32, expert_ids [max_padded / block_m] int32, the padded total
    [1] int32) for topk_ids [T, top_k] (see the module docstring); sizes depend only on T."""
    slots = topk_ids.numel()
    device = topk_ids.device
    max_padded = max_padded_rows(slots, num_experts, block_m)
    max_blocks = triton.cdiv(max_padded, block_m)
    sorted_ids = torch.empty((max_blocks * block_m,), dtype=torch.int32, device=device)
    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    total = torch.empty((1,), dtype=torch.int32, device=device)
    cursor = torch.empty((num_experts,), dtype=torch.int32, device=device)
    if slots == 0:
        total.zero_()
        return sorted_ids, expert_ids, total
    flat = topk_ids.reshape(-1)
    e_p2 = triton.next_power_of_2(num_experts + 1)
    fill_programs = triton.cdiv(sorted_ids.numel(), ALIGN_CHUNK)
    _layout[(1 + fill_programs,)](flat, sorted_ids, expert_ids, cursor, total, slots, num_experts, sorted_ids.numel(),
                                  max_blocks, BLOCK_M=block_m, E_P2=e_p2, CHUNK=ALIGN_CHUNK, BLOCKS=ALIGN_BLOCKS,
                                  num_warps=4)
    _scatter[(triton.cdiv(slots, ALIGN_CHUNK),)](flat, sorted_ids, cursor, slots, CHUNK=ALIGN_CHUNK, num_warps=4)
    return sorted_ids, expert_ids, total


def moe_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
             expert_ids: torch.Tensor, total: torch.Tensor, config: FusedMoeConfig, *, rows_per_a: int,
             gated: bool, routed_weights: Optional[torch.Tensor] = None, weight_scale: Optional[torch.Tensor] = None,
             scale_block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """out[pair] = a[pair // rows_per_a] @ weight[expert(pair)]^T for every routed pair (gated:
    silu(gate) * up of the gate|up weight [E, 2I, K], out [pairs, I]), times routed_weights[pair]
    if given. FP8 weights take `weight_scale` [E, N] (per output row) or, with `scale_block`
    (bn, bk), [E, ceil(N/bn), ceil(K/bk)]."""
    num_experts, n, k = weight.shape
    if a.shape[1] != k or a.stride(1) != 1 or weight.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError(f"moe_gemm: a {tuple(a.shape)} and weight {tuple(weight.shape)} do not fit "
                         "(K must match; rows contiguous)")
    if gated and n % 2:
        raise ValueError(f"moe_gemm: a gate|up weight needs an even N, got {n}")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (weight_scale is not None):
        raise ValueError("moe_gemm: FP8 weights need their weight_scale (and other weights none)")
    if scale_block is not None and not block_k_fits_scale_blocks(config, scale_block[1]):
        raise ValueError(f"moe_gemm: block_k={config.block_k} must divide the scale block's {scale_block[1]} columns")
    if gated and scale_block is not None and (n // 2) % scale_block[0]:
        raise ValueError(f"moe_gemm: the gate|up halves ({n // 2} rows) must be whole scale blocks of "
                         f"{scale_block[0]} rows")
    slots = out.shape[0]
    n_out = n // 2 if gated else n
    cols = config.block_n // 2 if gated else config.block_n
    num_m = expert_ids.numel()
    num_n = triton.cdiv(n_out, cols)
    if slots == 0 or num_m == 0:
        return out
    scale_mode = 0 if not fp8 else (2 if scale_block is not None else 1)
    scale = weight_scale if fp8 else weight
    if scale_mode == 2:
        strides = (scale.stride(0), scale.stride(1), scale.stride(2))
    elif scale_mode == 1:
        strides = (scale.stride(0), scale.stride(1), 0)
    else:
        strides = (0, 0, 0)
    stages = pipeline_stages(config, a.element_size(), weight.element_size())
    _gemm[(num_n * num_m,)](
        a, weight, out, scale, routed_weights if routed_weights is not None else a, sorted_ids, expert_ids, total,
        n, k, slots, num_m, a.stride(0), weight.stride(0), weight.stride(1), out.stride(0), *strides,
        ROWS_PER_A=rows_per_a, GATED=gated, MUL_ROUTED=routed_weights is not None, SCALE=scale_mode,
        SCALE_BN=scale_block[0] if scale_block else 1, SCALE_BK=scale_block[1] if scale_block else 1,
        EVEN_K=k % config.block_k == 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=stages)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config13: FusedMoeConfig, config2: FusedMoeConfig, *,
              w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
              scale_block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """x [T, H] through the experts: sum over j of topk_weights[t, j] * down_e(silu(gate_e(x)) *
    up_e(x)) with e = topk_ids[t, j]; w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]."""
    t, h = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_i, _ = w13.shape
    if config13.block_m != config2.block_m:
        raise ValueError("fused_moe: both GEMMs walk one alignment, so their block_m must match")
    slots = t * top_k
    sorted_ids, expert_ids, total = moe_align(topk_ids, num_experts, config13.block_m)
    inter = torch.empty((slots, two_i // 2), dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, inter, sorted_ids, expert_ids, total, config13, rows_per_a=top_k, gated=True,
             weight_scale=w13_scale, scale_block=scale_block)
    down = torch.empty((slots, w2.shape[1]), dtype=x.dtype, device=x.device)
    moe_gemm(inter, w2, down, sorted_ids, expert_ids, total, config2, rows_per_a=1, gated=False,
             routed_weights=topk_weights.reshape(-1), weight_scale=w2_scale, scale_block=scale_block)
    return topk_sum(down, t, top_k)


def topk_sum(rows: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T x top_k, H] (each token's top_k rows in turn) -> [T, H], summed in float32 in top-k order."""
    h = rows.shape[1]
    out = torch.empty((num_tokens, h), dtype=rows.dtype, device=rows.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(h))
        _sum[(num_tokens, triton.cdiv(h, block))](rows, out, num_tokens, h, TOP_K=top_k, BLOCK=block,
                                                  num_warps=4 if block >= 512 else 1)
    return out
