"""Which implementation the model's layers run: decided once, when the model is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from radixserve.settings import DECODE_GEMM_MAX_ROWS

if TYPE_CHECKING:
    from radixserve.kernels.decode_linear_config import DecodeLinearConfig

# The Triton kernels compute in float32 and round to these; float32 activations take the torch path.
TRITON_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelChoice:
    """triton: our Triton kernels (radixserve.kernels): RMSNorm with the residual add fused, RoPE
    with the KV store fused, SiLU-and-mul, and for projections of at most `decode_gemm_max_rows`
    rows the decode-row GEMM (SiLU-and-mul fused for gate|up; 0 turns it off). Otherwise torch
    ops in transformers' order of operations: the reference path (CPU, float32).

    Every layer reads this in its constructor and keeps what it picked; nothing changes it later.
    """

    triton: bool = False
    decode_gemm_max_rows: int = DECODE_GEMM_MAX_ROWS
    # The routed experts' fused MoE (radixserve.kernels.fused_moe); None: as `triton`. On CUDA it
    # runs in float32 too (the experts' reference loop reads the routing back to the host, which a
    # CUDA graph cannot hold), unless the Triton kernels are turned off.
    fused_moe: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.decode_gemm_max_rows < 0:
            raise ValueError(f"decode_gemm_max_rows must be >= 0, got {self.decode_gemm_max_rows}")
        if self.fused_moe is None:
            object.__setattr__(self, "fused_moe", self.triton)

    @classmethod
    def for_device(cls, device: torch.device | str, dtype: torch.dtype, *, triton: Optional[bool] = None,
                   decode_gemm_max_rows: int = DECODE_GEMM_MAX_ROWS) -> "KernelChoice":
        """triton=None: the Triton kernels on CUDA in bfloat16/float16 when triton is installed,
        torch ops elsewhere. triton=True off CUDA is a ValueError."""
        on_cuda = torch.device(device).type == "cuda"
        fused_moe = triton is not False and on_cuda and _triton_installed()
        if triton is None:
            triton = on_cuda and dtype in TRITON_DTYPES and _triton_installed()
        elif triton and not on_cuda:
            raise ValueError("the Triton kernels need a CUDA device")
        return cls(triton=triton, decode_gemm_max_rows=decode_gemm_max_rows, fused_moe=fused_moe)


def decode_gemm_plan(kernels: KernelChoice, weight: torch.Tensor, bias: Optional[torch.Tensor], act: Optional[object]
                     ) -> tuple[int, Optional["DecodeLinearConfig"]]:
    """(rows up to which a projection runs the decode-row GEMM, 0 for never; the kernel's variant
    for this weight): with the Triton kernels, for a weight it can tile, whose activation (if any)
    its epilogue fuses (SiLU-and-mul of a gate|up without a bias). Shapes and strides only: fine
    on the meta device."""
    fusable_act = act is None or (bias is None and weight.shape[0] % 2 == 0)
    if not (kernels.triton and kernels.decode_gemm_max_rows > 0 and fusable_act):
        return 0, None
    from radixserve.kernels.decode_linear_config import config_for

    config = config_for(weight)
    return (0, None) if config is None else (kernels.decode_gemm_max_rows, config)


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
