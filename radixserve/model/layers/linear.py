"""Projections: y = x @ W^T (+ bias), through cuBLAS or, for a decode batch's few rows, our
weight-streaming Triton GEMM; several projections of one input can share one weight (q|k|v,
gate|up) and load from the checkpoint shard by shard.

The weight format (plain, FP8 per channel, FP8 per block: radixserve.model.layers.quant_method)
owns the parameters, their loading and the forward; a projection kind says only where each
checkpoint tensor lands (`checkpoint_place`: its rows among the layer's, and under tensor
parallelism which part of it this rank holds, radixserve.model.layers.parallel).
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import nn

from radixserve.model.layers.activation import SiluAndMul
from radixserve.model.layers.fp8 import FP8_DECODE_ROWS_FACTOR, Fp8Activations
from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.layers.param_sharding import WHOLE, Cut, Destination, Loaded, copy_weight, load_param
from radixserve.model.layers.quant_method import LinearMethod, linear_method
from radixserve.model.quantization import Fp8Config

ShardId = Hashable
__all__ = ["FP8_DECODE_ROWS_FACTOR", "Linear", "MergedLinear", "ShardId", "copy_weight"]


class Linear(nn.Module):
    """x [M, input_size] -> [M, output_size], then `act` if given.

    `self.quant_method` (picked from `fp8` by radixserve.model.layers.quant_method.linear_method)
    holds the weights and runs the forward: with the Triton kernels, M of at most
    `decode_gemm_max_rows` rows runs the decode-row GEMM (radixserve.kernels.decode_linear;
    SiLU-and-mul fused into its epilogue when that is the activation) for weights it can tile;
    everything else runs F.linear (cuBLAS), then `act`. FP8 weights (radixserve.model.layers.fp8)
    take the FP8 decode-row GEMM up to FP8_DECODE_ROWS_FACTOR times as many rows; block-wise FP8
    (radixserve.model.layers.fp8_block) runs on CUDA as the bf16 weight it dequantizes to at
    load, so its decode rows take the bf16 decode-row GEMM.
    `weight`: share an existing parameter (a tied lm_head) instead of allocating one.
    `shards`: a MergedLinear's shard ids, in row order.
    A projection whose `takes_fp8_activations` is set (FP8, Triton kernels, dynamic activation
    scales) also takes its input already quantized per token (`Fp8Activations`, from the RMSNorm
    in front of it): the same GEMMs, minus the quantization launch.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype,
                 kernels: KernelChoice, act: Optional[SiluAndMul] = None, weight: Optional[nn.Parameter] = None,
                 fp8: Optional[Fp8Config] = None, shards: tuple[ShardId, ...] = (None,)):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self._shard_index = {shard_id: i for i, shard_id in enumerate(shards)}
        method = linear_method(fp8, len(shards), dtype, triton=kernels.triton)
        method.create_weights(self, input_size, output_size, dtype, weight)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.act = act
        method.choose_kernels(self, kernels)
        self.quant_method: LinearMethod = method
        # Fixed when built: the layer in front asks it on every forward.
        self.takes_fp8_activations = method.takes_fp8_activations(self)

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def checkpoint_place(self, shard_id: Optional[ShardId]) -> tuple[Cut, Destination]:
        """Where a checkpoint tensor of shard `shard_id` lands: the part of it this layer holds and
        its place among the layer's output rows (here: the whole tensor, every row)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        return WHOLE, Destination((0, self.output_size))

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[ShardId] = None) -> None:
        """Fill parameter `param` (whatever the weight format declares: "weight", "bias", FP8's
        scales) from one checkpoint tensor, cut as the format declares it shards."""
        cut, dest = self.checkpoint_place(shard_id)
        load_param(self, self.quant_method.params, param, loaded, cut, dest)

    def finish_loading(self) -> None:
        """Called by the loader once every checkpoint tensor is in."""
        self.quant_method.finish_loading(self)


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

    def checkpoint_place(self, shard_id: Optional[ShardId]) -> tuple[Cut, Destination]:
        if shard_id not in self.shard_rows:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r} (shards: {list(self.shard_rows)})")
        return WHOLE, Destination(self.shard_rows[shard_id], shard=self._shard_index[shard_id])
