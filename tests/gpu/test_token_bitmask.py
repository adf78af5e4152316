"""The packed-bitmask masking kernel against the unpacked reference, on the constrained rows only.

Runs on a CUDA GPU; skipped elsewhere (TRITON_INTERPRET=1 runs it on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.kernels.token_bitmask import apply_token_bitmask_rows_  # noqa: E402


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32)
    for i, row in enumerate(rows):
        allowed = ((bitmask[i, :, None].cpu() >> bits) & 1).bool().reshape(-1)[:vocab]
        out[row, ~allowed.to(out.device)] = float("-inf")
    return out


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("batch,vocab,rows", [(5, 512, [0, 3]), (3, 5000, [2, 0, 1]), (4, 77, []),
                                              (64, 2100, list(range(0, 64, 3)))])
def test_matches_reference(batch, vocab, rows, index_dtype):
    g = torch.Generator().manual_seed(batch * vocab)
    logits = torch.randn(batch, vocab, generator=g).to(DEVICE)
    words = (vocab + 31) // 32 + 1  # a padded row, as a persistent buffer has
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (len(rows), words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    if rows:
        bitmask[0] = -1  # a row that allows everything
    expected = reference(logits, bitmask, rows)
    out = apply_token_bitmask_rows_(logits, bitmask.to(DEVICE), torch.tensor(rows, dtype=index_dtype).to(DEVICE))
    assert out.data_ptr() == logits.data_ptr()
    assert torch.equal(out.cpu(), expected.cpu())
