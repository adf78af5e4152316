"""FP8 (e4m3) routed experts: what `FusedExperts` (radixserve.model.layers.moe) delegates its
weights' layout, loading and dequantization to under FP8.

Two layouts, both one byte per weight:
- per output channel: `w13_weight_scale` [E, 2 I_r] and `w2_weight_scale` [E, H] float32, one
  scale per expert per output row. Quantized at load from a bf16/fp16/fp32 checkpoint
  (`--quantization fp8`: each row's max |w| maps to 448, as the dense FP8 projections), or read
  from an FP8 checkpoint's per-tensor (expanded over the tensor's rows) or per-channel
  `weight_scale`.
- per block (`weight_block_size` [bn, bk], the Qwen3 FP8 releases' 128 x 128):
  `w13_weight_scale_inv` [E, 2 I_r / bn, H / bk] and `w2_weight_scale_inv` [E, H / bn, I_r / bk],
  one scale per block (despite the name it multiplies). The gate and up halves must be whole
  row blocks, and each rank's slice of the intermediate too (else a scale would cover two
  tensors, or two ranks): refused when the layer is built, naming the sizes.

Activations stay in the model dtype (weight-only FP8): the fused kernel widens each e4m3 tile in
registers and applies the scales in float32; the CPU reference dequantizes each expert's weights
(e4m3 x scale in float32) and runs the same expert loop as plain weights.

Under tensor parallelism a rank reads its gate/up rows with their scale rows, and its down input
columns with their scale columns (block-wise) or every row's whole scale (per channel). Quantized
at load, a rank reads each whole down row once so its scale, and every e4m3 value, is tp 1's.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from radixserve.model.layers.fp8 import FP8_DTYPE, load_fp8_weight, load_row_scales, quantize_rows
from radixserve.model.layers.fp8_block import expand_blocks, load_block_scales, quantize_blocks
from radixserve.model.layers.param_sharding import ROWS, ROWS_OR_ONE, WEIGHT, CheckpointPart, Destination, ParamSpec, \
    blocks
from radixserve.model.moe_config import check_expert_blocks
from radixserve.model.quantization import Fp8Config


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8ExpertsMethod:
    """The FP8 format of one `FusedExperts` (see the module docstring). `dtype`: the model dtype
    (what the reference dequantizes to, and the activations' dtype).

    Sharding, per expert tensor (a gate or up weight is cut by rows, a down weight by columns):
    the weights by rows and columns, per-channel scales by rows or, one value per tensor, whole;
    block scales by block rows and block columns.
    """

    quantized = True

    def __init__(self, config: Fp8Config, dtype: torch.dtype, *, tp_size: int = 1, triton: bool = False):
        if config.static_activations:
            raise ValueError(f"{config.source}: FP8 experts with static activation scales (input_scale) are not "
                             "supported; the experts keep their activations in the model dtype (dynamic schemes "
                             "and block-wise checkpoints load)")
        self.config = config
        self.block = config.block
        self.dtype = dtype
        self.tp_size = tp_size
        self.triton = triton
        # What the checkpoint holds per expert projection (nothing but the weight: quantized at load).
        if self.block is not None:
            self.checkpoint_suffixes: tuple[str, ...] = ("weight", "weight_scale_inv")
        elif config.from_checkpoint:
            self.checkpoint_suffixes = ("weight", "weight_scale")
        else:
            self.checkpoint_suffixes = ("weight",)
        self.params: dict[str, ParamSpec] = {}
        for ours in ("w13", "w2"):
            self.params[f"{ours}_weight"] = ParamSpec(WEIGHT, partial(self._load_weight, scale=f"{ours}_weight_scale"))
            if self.block is not None:
                self.params[f"{ours}_weight_scale_inv"] = ParamSpec(blocks(*self.block), load_block_scales)
            elif config.from_checkpoint:
                self.params[f"{ours}_weight_scale"] = ParamSpec(ROWS_OR_ONE, load_row_scales)

    def create_weights(self, layer: nn.Module) -> None:
        e, h, inter = layer.num_experts, layer.hidden_size, layer.inter
        check_expert_blocks(self.block, inter * self.tp_size, self.tp_size, source=self.config.source)
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * inter, h, dtype=FP8_DTYPE), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, inter, dtype=FP8_DTYPE), requires_grad=False)
        if self.block is not None:
            bn, bk = self.block
            layer.w13_weight_scale_inv = nn.Parameter(
                torch.ones(e, _cdiv(2 * inter, bn), _cdiv(h, bk), dtype=torch.float32), requires_grad=False)
            layer.w2_weight_scale_inv = nn.Parameter(
                torch.ones(e, _cdiv(h, bn), _cdiv(inter, bk), dtype=torch.float32), requires_grad=False)
            return
        s13 = torch.ones(e, 2 * inter, dtype=torch.float32)
        s2 = torch.ones(e, h, dtype=torch.float32)
        if self.config.from_checkpoint:
            layer.w13_weight_scale = nn.Parameter(s13, requires_grad=False)
            layer.w2_weight_scale = nn.Parameter(s2, requires_grad=False)
        else:  # filled as the weights are quantized
            layer.register_buffer("w13_weight_scale", s13)
            layer.register_buffer("w2_weight_scale", s2)

    # ------------------------------------------------------------------ loading
    def _load_weight(self, layer: nn.Module, name: str, part: CheckpointPart, dest: Destination, *,
                     scale: str) -> None:
        """One expert's gate, up or down weight; quantized here, each row's scale into `scale`
        (block-wise checkpoints are FP8 already: no per-row scale is filled)."""
        rows = None if self.block is not None else dest.view(getattr(layer, scale), ROWS)
        load_fp8_weight(self.config, part, dest.view(getattr(layer, name), WEIGHT), rows)

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        """Random N(0, std) experts quantized per row or per block (--load-format dummy), one expert
        at a time (float32 temporaries of one expert)."""
        for e in range(layer.num_experts):
            for weight, scale_name in ((layer.w13_weight, "w13"), (layer.w2_weight, "w2")):
                w = torch.empty(weight.shape[1:], dtype=torch.float32, device=weight.device)
                w.normal_(0.0, std, generator=generator)
                if self.block is not None:
                    wq, scale = quantize_blocks(w, self.block)
                    getattr(layer, f"{scale_name}_weight_scale_inv")[e].copy_(scale)
                else:
                    wq, scale = quantize_rows(w)
                    getattr(layer, f"{scale_name}_weight_scale")[e].copy_(scale)
                weight[e].copy_(wq)

    def finish_loading(self, layer: nn.Module) -> None:
        """Nothing to convert: both paths read the e4m3 weights as loaded."""

    # ------------------------------------------------------------------ forward
    def dequantized(self, layer: nn.Module, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2 I_r, H], w2 [H, I_r]) of one expert as float32: e4m3 x its scale."""
        w13, w2 = layer.w13_weight[expert], layer.w2_weight[expert]
        if self.block is not None:
            return (w13.float() * expand_blocks(layer.w13_weight_scale_inv[expert], *w13.shape, self.block),
                    w2.float() * expand_blocks(layer.w2_weight_scale_inv[expert], *w2.shape, self.block))
        return (w13.float() * layer.w13_weight_scale[expert][:, None],
                w2.float() * layer.w2_weight_scale[expert][:, None])

    def kernel_args(self, layer: nn.Module) -> dict[str, Any]:
        if self.block is not None:
            return dict(w13_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv,
                        scale_block=self.block)
        return dict(w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale)

    def fit_configs(self, c13, c2):
        """Block-wise scales: every K tile inside one scale block (block_k divides bk)."""
        if self.block is None:
            return c13, c2
        from dataclasses import replace

        bk = self.block[1]
        fit = [c if bk % c.block_k == 0 else replace(c, block_k=max(16, math.gcd(bk, c.block_k))) for c in (c13, c2)]
        return fit[0], fit[1]
