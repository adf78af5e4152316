"""RMSNorm, alone or with the residual add folded in (transformers' Qwen2RMSNorm numerics), and
optionally with the per-token FP8 quantization of the projection after it folded in too."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from radixserve.model.layers.fp8 import Fp8Activations, quantize_activations
from radixserve.model.layers.kernel_choice import KernelChoice

Normed = Union[torch.Tensor, Fp8Activations]


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

    `fp8=True`: the normed rows come quantized per token for an FP8 projection (`Fp8Activations`
    over x's rows, results in x's dtype), exactly what that projection would make of the normed
    tensor. On the Triton path the norm kernel writes the e4m3 values and scales itself
    (radixserve.kernels.norm.rms_norm_fp8): the projection's quantization launch is saved. The
    torch path quantizes its normed tensor with torch ops.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, kernels: KernelChoice):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps
        self._norm_fp8 = None
        if kernels.triton:
            from radixserve.kernels.norm import add_rms_norm, rms_norm, rms_norm_fp8

            self._norm, self._add_norm, self._norm_fp8 = rms_norm, add_rms_norm, rms_norm_fp8
        else:
            self._norm, self._add_norm = torch_rms_norm, torch_add_rms_norm

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, fp8: bool = False
                ) -> Union[Normed, tuple[Normed, torch.Tensor]]:
        if fp8:
            return self._forward_fp8(x, residual)
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)

    def _forward_fp8(self, x: torch.Tensor, residual: Optional[torch.Tensor]
                     ) -> Union[Fp8Activations, tuple[Fp8Activations, torch.Tensor]]:
        if self._norm_fp8 is not None:
            values, scales = self._norm_fp8(x, self.weight, self.eps, residual)
            out = Fp8Activations(values, scales, x.dtype)  # the kernel's bf16 row is x's dtype
        else:
            normed = self.forward(x, residual)
            if residual is not None:
                normed, residual = normed
            out = Fp8Activations(*quantize_activations(normed.reshape(-1, normed.shape[-1]), None), normed.dtype)
        return out if residual is None else (out, residual)
