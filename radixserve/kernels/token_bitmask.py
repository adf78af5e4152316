"""Grammar masking on the device from the packed token bitmask, for the constrained rows only.

xgrammar fills one int32 word per 32 tokens (bit j of word w allows token 32 * w + j). The kernel
reads those words directly and writes -inf over each forbidden logit in place: no [rows, vocab]
boolean mask is ever built, and the rows of unconstrained requests are not touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.launch import FastKernel

BLOCK = 2048


@triton.jit
def _apply_token_bitmask_kernel(Logits, Bitmask, Rows, stride_logits, stride_bitmask, vocab, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(Rows + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    words = tl.load(Bitmask + i.to(tl.int64) * stride_bitmask + offs // 32, mask=in_vocab, other=-1)
    allowed = (words >> (offs % 32)) & 1
    tl.store(Logits + row * stride_logits + offs, float("-inf"), mask=in_vocab & (allowed == 0))


_apply_token_bitmask = FastKernel(_apply_token_bitmask_kernel)


def apply_token_bitmask_rows_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Set logits[rows[i], t] = -inf for every token t that bitmask row i forbids (in place).

    logits: [S, V] float on the device; bitmask: int32 [len(rows), >= ceil(V / 32)] on the same
    device; rows: int64 or int32 [R] logits row of each bitmask row (distinct)."""
    vocab = logits.shape[-1]
    assert bitmask.dtype == torch.int32 and bitmask.shape[-1] * 32 >= vocab
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    if rows.numel():
        grid = (rows.numel(), triton.cdiv(vocab, BLOCK))
        _apply_token_bitmask[grid](logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab, BLOCK=BLOCK,
                                   num_warps=4)
    return logits
