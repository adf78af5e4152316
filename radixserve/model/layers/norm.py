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


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next's and Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + weight), computed in
    float32 and rounded once (transformers' order: the scale multiplies the float32 row). The
    checkpoint's `weight` is loaded as is (its init is 0); `finish_loading` keeps 1 + weight in
    float32 for the forward pass, so a bf16 weight near 0 loses nothing to a bf16 1 + w.

    Same interface as RMSNorm (`norm(x)`, `norm(x, residual)`, no FP8 output). On the Triton path
    the RMSNorm kernels run with the float32 scale (they round the normalised row to x's dtype
    before scaling it: one rounding more than transformers, within bf16's precision)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, kernels: KernelChoice):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps
        self.scale: Optional[torch.Tensor] = None
        self._triton = kernels.triton
        if kernels.triton:
            from radixserve.kernels.norm import add_rms_norm, rms_norm

            self._norm, self._add_norm = rms_norm, add_rms_norm

    def finish_loading(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.scale is None:
            self.finish_loading()
        if self._triton:
            if residual is None:
                return self._norm(x, self.scale, self.eps)
            return self._add_norm(x, residual, self.scale, self.eps)
        if residual is None:
            return self._torch(x)
        summed = x + residual
        return self._torch(summed), summed

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm over each head's values: weight * x / rms(x) (normalised in
    float32, rounded to x's dtype, then scaled), times SiLU(gate) in float32, rounded once more:
    transformers' Qwen3NextRMSNormGated. x, gate [rows, head_dim]."""
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)
