"""Weight formats: what a projection (`Linear` and its fused and parallel kinds) or the routed
experts (`FusedExperts`) delegate their parameters and their forward to. A format is one object
per layer, picked once when the layer is built (`linear_method`, `experts_method`: the one place
a new format is added), that

- creates the layer's parameters (`create_weights`) and declares, per checkpoint parameter, how
  it shards and what loads it (`params`: radixserve.model.layers.param_sharding), so the layers'
  loaders cut every tensor from the declarations and never ask a parameter's name;
- converts once everything is in (`finish_loading`), fills random weights (`fill_dummy`, for
  --load-format dummy; plain weights take the loader's generic init, so `quantized` is False);
- runs the layer's forward: `Linear.forward` is `self.quant_method.apply(self, x)`, which picks
  the kernel (the decode-row GEMM for a decode step's few rows, radixserve.kernels.decode_linear*,
  else cuBLAS or the CPU reference) from what `choose_kernels` chose when the layer was built.

Formats: plain weights (radixserve.model.layers.unquantized), per-channel FP8
(radixserve.model.layers.fp8), 128 x 128 block FP8 (radixserve.model.layers.fp8_block), and the
experts of each (unquantized, radixserve.model.layers.moe_fp8).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

import torch
from torch import nn

from radixserve.model.layers.fp8 import Fp8LinearMethod
from radixserve.model.layers.fp8_block import Fp8BlockLinearMethod
from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.layers.moe_fp8 import Fp8ExpertsMethod
from radixserve.model.layers.param_sharding import ParamSpec
from radixserve.model.layers.unquantized import UnquantizedExpertsMethod, UnquantizedLinearMethod
from radixserve.model.quantization import Fp8Config


class LinearMethod(Protocol):
    """The weight format of one projection (see the module docstring)."""

    quantized: bool
    # Checkpoint parameter name -> its sharding and loader; filled by create_weights.
    params: Mapping[str, ParamSpec]

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shared: Optional[nn.Parameter]) -> None: ...

    def choose_kernels(self, layer: nn.Module, kernels: KernelChoice) -> None: ...

    def takes_fp8_activations(self, layer: nn.Module) -> bool: ...

    def finish_loading(self, layer: nn.Module) -> None: ...

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None: ...

    def apply(self, layer: nn.Module, x: Any) -> torch.Tensor: ...


class ExpertsMethod(Protocol):
    """The weight format of one `FusedExperts`: every expert's gate|up `w13_*` and down `w2_*`."""

    quantized: bool
    params: Mapping[str, ParamSpec]
    # What the checkpoint holds per expert projection: "weight", and a format's scales.
    checkpoint_suffixes: tuple[str, ...]

    def create_weights(self, layer: nn.Module) -> None: ...

    def finish_loading(self, layer: nn.Module) -> None: ...

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None: ...

    def dequantized(self, layer: nn.Module, expert: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def kernel_args(self, layer: nn.Module) -> dict[str, Any]: ...

    def fit_configs(self, c13: Any, c2: Any) -> tuple[Any, Any]: ...


# --------------------------------------------------------------------------- the choice

def linear_method(fp8: Optional[Fp8Config], num_shards: int, dtype: torch.dtype, *, triton: bool) -> LinearMethod:
    """The format of a projection of `num_shards` fused shards: plain, per-channel FP8 or block FP8."""
    if fp8 is None:
        return UnquantizedLinearMethod()
    if fp8.block is None:
        return Fp8LinearMethod(fp8, num_shards, triton=triton)
    return Fp8BlockLinearMethod(fp8, num_shards, dtype, triton=triton)


def experts_method(fp8: Optional[Fp8Config], dtype: torch.dtype, *, tp_size: int, triton: bool) -> ExpertsMethod:
    """The format of the routed experts: plain, or FP8 per channel or per block."""
    if fp8 is None:
        return UnquantizedExpertsMethod(dtype)
    return Fp8ExpertsMethod(fp8, dtype, tp_size=tp_size, triton=triton)
