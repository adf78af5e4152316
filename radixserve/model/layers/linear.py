"""Projections: y = x @ W^T (+ bias), through cuBLAS or, for a decode batch's few rows, our
weight-streaming Triton GEMM; several projections of one input can share one weight (q|k|v,
gate|up) and load from the checkpoint shard by shard."""

from __future__ import annotations

from typing import Hashable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.layers.activation import SiluAndMul
from radixserve.model.layers.fp8 import Fp8Activations, Fp8LinearMethod
from radixserve.model.layers.fp8_block import Fp8BlockLinearMethod
from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.quantization import Fp8Config

ShardId = Hashable
# FP8 projections run the decode-row GEMM up to this many times `decode_gemm_max_rows` rows.
FP8_DECODE_ROWS_FACTOR = 2


def copy_weight(dest: torch.Tensor, loaded: torch.Tensor) -> None:
    """dest <- loaded (cast to dest's dtype and device); ValueError when the shapes differ, or when
    an FP8 tensor would be cast (without its scale it is not the weight)."""
    if loaded.dtype == torch.float8_e4m3fn and dest.dtype != loaded.dtype:
        raise ValueError("is FP8, but this parameter is not (an FP8 checkpoint needs its quantization_config in "
                         "config.json)")
    if tuple(loaded.shape) != tuple(dest.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(dest.shape)} from config.json")
    dest.copy_(loaded)


class Linear(nn.Module):
    """x [M, input_size] -> [M, output_size], then `act` if given.

    With the Triton kernels, M of at most `decode_gemm_max_rows` rows runs the decode-row GEMM
    (radixserve.kernels.decode_linear; SiLU-and-mul fused into its epilogue when that is the
    activation) for weights it can tile; everything else runs F.linear (cuBLAS), then `act`.
    `weight`: share an existing parameter (a tied lm_head) instead of allocating one.
    `fp8`: hold FP8 weights; `self.quant` (radixserve.model.layers.fp8) then owns the weight's
    layout, its loading and the matmul (`shards`: a MergedLinear's shard ids, in row order);
    FP8 weights take the decode-row GEMM up to FP8_DECODE_ROWS_FACTOR times as many rows;
    block-wise FP8 (radixserve.model.layers.fp8_block) runs on CUDA as the bf16 weight it
    dequantizes to at load, so its decode rows take the bf16 decode-row GEMM.
    An FP8 projection whose `takes_fp8_activations` is set also takes its input already quantized
    per token (`Fp8Activations`, from the RMSNorm in front of it): the same GEMMs, minus the
    quantization launch.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype,
                 kernels: KernelChoice, act: Optional[SiluAndMul] = None, weight: Optional[nn.Parameter] = None,
                 fp8: Optional[Fp8Config] = None, shards: tuple[ShardId, ...] = (None,)):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.quant: Optional[Fp8LinearMethod | Fp8BlockLinearMethod] = None
        if fp8 is not None:
            if weight is not None:
                raise ValueError("an FP8 projection cannot share another layer's weight")
            self.quant = Fp8LinearMethod(fp8, list(shards), triton=kernels.triton) if fp8.block is None else \
                Fp8BlockLinearMethod(fp8, list(shards), dtype, triton=kernels.triton)
            self.quant.create_weights(self, input_size, output_size)
        elif weight is None:
            weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        elif tuple(weight.shape) != (output_size, input_size):
            raise ValueError(f"a shared weight of shape {tuple(weight.shape)} is not ({output_size}, {input_size})")
        if weight is not None:
            self.weight = weight
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.act = act
        # Rows up to which the decode-row GEMM runs (0: never), and the variant it runs for this weight.
        self._decode_max_rows = 0
        self._decode_config = None
        fusable_act = act is None or (not bias and output_size % 2 == 0)
        if kernels.triton and kernels.decode_gemm_max_rows > 0 and fusable_act:
            from radixserve.kernels.decode_linear import decode_linear
            from radixserve.kernels.decode_linear_config import config_for

            self._decode_config = config_for(self.weight)  # shape and strides only: fine on the meta device
            if self._decode_config is not None:
                self._decode_linear = decode_linear
                self._decode_max_rows = kernels.decode_gemm_max_rows
                if isinstance(self.quant, Fp8LinearMethod):
                    from radixserve.kernels.decode_linear_fp8 import decode_linear_fp8

                    self._decode_linear = self._fp8_decode_linear
                    self._decode_linear_fp8 = decode_linear_fp8
                    # e4m3 tiles are half the bytes: on an H200 this GEMM beat cuBLASLt's FP8 GEMM
                    # (with its activation quantization) up to twice bf16's limit
                    # (docs/runs/2026-12-02-fp8-activations-agent-vs-fcfs.md).
                    self._decode_max_rows *= FP8_DECODE_ROWS_FACTOR
        # Per-token FP8 activations from the layer before are what this projection would make of a
        # bf16 input itself: with the Triton kernels, on every path (the decode-row GEMM's default
        # "token_fp8" mode and cuBLASLt's FP8 GEMM quantize per token the same way).
        self._fp8_token_input = isinstance(self.quant, Fp8LinearMethod) and self.quant.triton and (
            self._decode_config is None or self._decode_config.fp8_mode == "token_fp8")

    @property
    def takes_fp8_activations(self) -> bool:
        """Whether the layer in front may hand this projection `Fp8Activations` (per token) instead
        of a tensor: FP8 weights with the Triton kernels and dynamic activation scales (a static
        `input_scale` quantizes differently)."""
        return self._fp8_token_input and self.input_scale is None

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        rows = x
        if isinstance(x, Fp8Activations):
            if not isinstance(self.quant, Fp8LinearMethod):
                raise TypeError(f"{type(self).__name__}: Fp8Activations are for FP8 weights with per-row scales; "
                                "this projection takes a tensor")
            rows = x.values
        if 0 < rows.shape[0] <= self._decode_max_rows and rows.stride(-1) == 1:
            return self._decode_linear(x, self.weight, self.bias, self._decode_config, silu_mul=self.act is not None)
        y = F.linear(x, self.weight, self.bias) if self.quant is None else self.quant.apply(self, x)
        return y if self.act is None else self.act.forward(y)

    def _fp8_decode_linear(self, x: torch.Tensor | Fp8Activations, weight: torch.Tensor,
                           bias: Optional[torch.Tensor], config, silu_mul: bool) -> torch.Tensor:
        if isinstance(x, Fp8Activations):  # quantized per token already
            return self._decode_linear_fp8(x.values, weight, self.weight_scale, bias, config, silu_mul=silu_mul,
                                           x_scale=x.scales, out_dtype=x.dtype)
        return self._decode_linear_fp8(x, weight, self.weight_scale, bias, config, silu_mul=silu_mul,
                                       input_scale=self.quant.static_scale)

    def load_weight(self, param: str, loaded: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        """Fill parameter `param` ("weight" or "bias"; FP8 also "weight_scale", "input_scale", or
        block-wise "weight_scale_inv") from one checkpoint tensor."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if self.quant is not None:
            self.quant.load(self, param, loaded, None, (0, self.output_size))
            return
        copy_weight(getattr(self, param), loaded)

    def finish_loading(self) -> None:
        """Called by the loader once every checkpoint tensor is in."""
        if self.quant is not None:
            self.quant.finish_loading(self)


class MergedLinear(Linear):
    """Projections of the same input stacked by output rows in one weight (and bias), so they run
    as one GEMM: `shards` names each one (the checkpoint loads it by that id) with its output size,
    in row order. q|k|v: {"q": Hq*D, "k": Hkv*D, "v": Hkv*D}; gate|up: {0: I, 1: I}."""

    def __init__(self, input_size: int, shards: dict[ShardId, int], *, bias: bool, dtype: torch.dtype,
                 kernels: KernelChoice, act: Optional[SiluAndMul] = None, fp8: Optional[Fp8Config] = None):
        super().__init__(input_size, sum(shards.values()), bias=bias, dtype=dtype, kernels=kernels, act=act,
                         fp8=fp8, shards=tuple(shards))
        self.shard_rows: dict[ShardId, tuple[int, int]] = {}
        start = 0
        for shard_id, size in shards.items():
            self.shard_rows[shard_id] = (start, size)
            start += size

    def load_weight(self, param: str, loaded: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        if shard_id not in self.shard_rows:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r} (shards: {list(self.shard_rows)})")
        start, size = self.shard_rows[shard_id]
        if self.quant is not None:
            self.quant.load(self, param, loaded, shard_id, (start, size))
            return
        copy_weight(getattr(self, param).narrow(0, start, size), loaded)
