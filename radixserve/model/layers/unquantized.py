"""Plain weights in the model dtype: the weight format of a projection or of the routed experts
when the model is not quantized (radixserve.model.layers.quant_method says what a format does)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.layers.kernel_choice import KernelChoice, decode_gemm_plan
from radixserve.model.layers.param_sharding import ROWS, WEIGHT, ParamSpec


class UnquantizedLinearMethod:
    """`weight` [N, K] in the model dtype (or a shared parameter: a tied lm_head) and `bias` [N]:
    the decode-row GEMM up to `decode_max_rows` rows (SiLU-and-mul fused when that is the
    layer's activation), else F.linear (cuBLAS), then the activation."""

    quantized = False

    def __init__(self) -> None:
        self.params: dict[str, ParamSpec] = {"weight": ParamSpec(WEIGHT), "bias": ParamSpec(ROWS)}
        self.decode_max_rows = 0  # 0: never the decode-row GEMM
        self.decode_config = None

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shared: Optional[nn.Parameter]) -> None:
        if shared is None:
            shared = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        elif tuple(shared.shape) != (output_size, input_size):
            raise ValueError(f"a shared weight of shape {tuple(shared.shape)} is not ({output_size}, {input_size})")
        layer.weight = shared

    def choose_kernels(self, layer: nn.Module, kernels: KernelChoice) -> None:
        self.decode_max_rows, self.decode_config = decode_gemm_plan(kernels, layer.weight, layer.bias, layer.act)
        if self.decode_max_rows:
            from radixserve.kernels.decode_linear import decode_linear

            self._decode_linear = decode_linear

    def takes_fp8_activations(self, layer: nn.Module) -> bool:
        return False

    def finish_loading(self, layer: nn.Module) -> None:
        """Nothing to convert."""

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        raise TypeError("plain weights take the loader's generic dummy init (quantized is False)")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= self.decode_max_rows and x.stride(-1) == 1:
            return self._decode_linear(x, layer.weight, layer.bias, self.decode_config, silu_mul=layer.act is not None)
        y = F.linear(x, layer.weight, layer.bias)
        return y if layer.act is None else layer.act.forward(y)


class UnquantizedExpertsMethod:
    """`w13_weight` [E, 2 I_r, H] and `w2_weight` [E, H, I_r] in the model dtype."""

    quantized = False
    checkpoint_suffixes = ("weight",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.params: dict[str, ParamSpec] = {"w13_weight": ParamSpec(WEIGHT), "w2_weight": ParamSpec(WEIGHT)}

    def create_weights(self, layer: nn.Module) -> None:
        e, h, inter = layer.num_experts, layer.hidden_size, layer.inter
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * inter, h, dtype=self.dtype))
        layer.w2_weight = nn.Parameter(torch.empty(e, h, inter, dtype=self.dtype))

    def finish_loading(self, layer: nn.Module) -> None:
        """Nothing to convert."""

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        raise TypeError("plain weights take the loader's generic dummy init (quantized is False)")

    def dequantized(self, layer: nn.Module, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.w13_weight[expert], layer.w2_weight[expert]

    def kernel_args(self, layer: nn.Module) -> dict[str, Any]:
        return {}

    def fit_configs(self, c13: Any, c2: Any) -> tuple[Any, Any]:
        return c13, c2
