"""RMSNorm, alone or with the residual add folded in (transformers' Qwen2RMSNorm numerics)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from radixserve.model.layers.kernel_choice import KernelChoice


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF: normalise in fp32, cast back, then scale.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return torch_rms_norm(summed, weight, eps), summed


class RMSNorm(nn.Module):
    """`norm(x)` -> weight * x / rms(x); `norm(x, residual)` -> (norm(x + residual), x + residual),
    the sum rounded to x's dtype before it is normalised, as an unfused `x + residual` is.

    Folding the residual add into the next norm saves a launch per sub-block on the Triton path
    (one kernel does both and updates `residual` in place); the torch path adds out of place.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, kernels: KernelChoice):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps
        if kernels.triton:
            from radixserve.kernels.norm import add_rms_norm, rms_norm

            self._norm, self._add_norm = rms_norm, add_rms_norm
        else:
            self._norm, self._add_norm = torch_rms_norm, torch_add_rms_norm

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)
