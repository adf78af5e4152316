"""SiLU(gate) * up over a fused gate|up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.layers.kernel_choice import KernelChoice


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[..., 2I] (gate first, then up) -> [..., I]. A `Linear` given this as its activation fuses
    it into the decode-row GEMM's epilogue where that GEMM runs."""

    def __init__(self, *, kernels: KernelChoice):
        super().__init__()
        if kernels.triton:
            from radixserve.kernels.activation import silu_and_mul

            self._fn = silu_and_mul
        else:
            self._fn = torch_silu_and_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fn(gate_up)
