"""Block-wise FP8 projections: the `fp8` format with `weight_block_size` [bn, bk] (the DeepSeek-V3
/ Qwen3-FP8 layout).

The weight is e4m3 [N, K] with one float32 `weight_scale_inv` per bn x bk block ([ceil(N/bn),
ceil(K/bk)]; despite the name it multiplies: weight = e4m3 x scale). Activations are quantized
per token per bk columns (dynamic), so each product of one activation group with one weight block
has one scale on either side.

The fused q|k|v and gate|up weights stack their checkpoint tensors by rows: each shard must start
on a bn-row block, else one block's scale would have to cover two tensors. Such checkpoints are
refused when the model is built (radixserve.model.quantization.check_block_alignment), as is a
tensor-parallel size that would cut a rank's rows or input columns off the block grid (the
Qwen2 7B and 72B shapes keep every tp 1 cut on 128; at tp > 1 see docs/tensor_parallel.md, "FP8 weights").

Paths:
- CPU (the reference): activations quantized and dequantized per token per bk group, the weight
  dequantized block by block, then an fp32 matmul.
- CUDA (and wherever the layer runs the Triton kernels): the weight is dequantized once at load
  into the model dtype (bf16: two bytes per weight, what a bf16 checkpoint holds, twice the FP8
  bytes) and runs as a plain projection (cuBLAS, and the bf16 decode-row GEMM), activations
  unquantized. A correct fallback: it costs FP8's memory
  and decode-speed gains, not accuracy. torch's block-wise scaled GEMM (1x128 activations, 128x128
  weights on Hopper with CUDA 12.9+) would keep one byte per weight; it is not used yet.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, load_fp8_weight, quantize_with
from radixserve.model.layers.kernel_choice import KernelChoice, decode_gemm_plan
from radixserve.model.layers.param_sharding import ROWS, WEIGHT, CheckpointPart, Destination, ParamSpec, blocks
from radixserve.model.quantization import Fp8Config


# Weight rows dequantized per step (float32 temporaries of about 2 x 1,024 x K x 4 bytes).
DEQUANT_ROWS = 1024


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """float32 [rows, cols]: each block's scale over its bn x bk elements (edge blocks cut)."""
    bn, bk = block
    return scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] in `dtype`: e4m3 weight x its block's scale, computed in float32 a few block rows at
    a time, so the float32 temporaries stay small (on a GPU, the KV pool is sized from the memory
    left after loading, cached temporaries included)."""
    n, k = weight.shape
    bn = block[0]
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    step = bn * max(1, DEQUANT_ROWS // bn)
    for start in range(0, n, step):
        rows = weight[start:start + step]
        scales = scale[start // bn:(start + rows.shape[0] + bn - 1) // bn]
        out[start:start + rows.shape[0]] = rows.float() * expand_blocks(scales, rows.shape[0], k, block)
    return out


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [ceil(N/bn), ceil(K/bk)]: the scale that maps each block's largest |value| to 448."""
    bn, bk = block
    n, k = w.shape
    padded = F.pad(w.float().abs(), (0, _cdiv(k, bk) * bk - k, 0, _cdiv(n, bn) * bn - n))
    amax = padded.view(_cdiv(n, bn), bn, _cdiv(k, bk), bk).amax(dim=(1, 3))
    return (amax / FP8_MAX).clamp_min(MIN_SCALE)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], float32 block scales [ceil(N/bn), ceil(K/bk)])."""
    scale = block_scales(w, block)
    return quantize_with(w, expand_blocks(scale, *w.shape, block)), scale


def quantize_activation_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, ceil(K/group)]): each token's every `group` columns scaled
    so their largest |value| maps to 448."""
    m, k = x.shape
    padded = F.pad(x.float().abs(), (0, _cdiv(k, group) * group - k))
    scale = (padded.view(m, -1, group).amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    return quantize_with(x, scale.repeat_interleave(group, 1)[:, :k]), scale


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                               bias: Optional[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
    """What a block-wise FP8 GEMM computes, in fp32: activations quantized per token per bk
    columns times the block-dequantized weight, + bias; in x's dtype."""
    bk = block[1]
    xq, x_scale = quantize_activation_groups(x, bk)
    xd = xq.float() * x_scale.repeat_interleave(bk, 1)[:, :x.shape[1]]
    y = xd @ dequantize_blocks(weight, scale, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Fp8BlockLinearMethod:
    """The block-wise FP8 format of one `Linear` (a MergedLinear's shards included).

    `create_weights` registers on the layer `weight` e4m3 [N, K] and `weight_scale_inv` float32
    [ceil(N/bn), ceil(K/bk)], both filled from the checkpoint; `input_scale` is None (dynamic
    activations only). `dtype`: what the CUDA path dequantizes to. `triton`: the layer runs the
    Triton kernels (its decode rows the bf16 decode-row GEMM), so the weight is dequantized at
    load wherever it is (the Triton interpreter runs on the CPU).

    Sharding: `weight` by rows and columns, `weight_scale_inv` by block rows and block columns
    (a rank's rows or columns start on the block grid: check_block_alignment), `bias` by rows.
    """

    quantized = True

    def __init__(self, config: Fp8Config, num_shards: int, dtype: torch.dtype, triton: bool = False):
        if config.block is None:
            raise ValueError("Fp8BlockLinearMethod needs a weight_block_size")
        self.config = config
        self.block = config.block
        self.num_shards = num_shards
        self.dtype = dtype
        self.triton = triton
        self.decode_max_rows = 0  # set by choose_kernels; 0: never the decode-row GEMM
        self.decode_config = None
        self.params: dict[str, ParamSpec] = {
            "weight": ParamSpec(WEIGHT, self._load_weight),
            "weight_scale_inv": ParamSpec(blocks(*self.block), load_block_scales),
            "bias": ParamSpec(ROWS),
        }

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shared: Optional[nn.Parameter]) -> None:
        if shared is not None:
            raise ValueError("an FP8 projection cannot share another layer's weight")
        bn, bk = self.block
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(torch.ones(_cdiv(output_size, bn), _cdiv(input_size, bk),
                                                         dtype=torch.float32), requires_grad=False)
        layer.register_parameter("input_scale", None)

    def choose_kernels(self, layer: nn.Module, kernels: KernelChoice) -> None:
        """The bf16 decode-row GEMM (over the weight dequantized at load), its variant chosen for
        this [N, K] now."""
        self.decode_max_rows, self.decode_config = decode_gemm_plan(kernels, layer.weight, layer.bias, layer.act)
        if self.decode_max_rows:
            from radixserve.kernels.decode_linear import decode_linear

            self._decode_linear = decode_linear

    def takes_fp8_activations(self, layer: nn.Module) -> bool:
        return False

    def _load_weight(self, layer: nn.Module, name: str, part: CheckpointPart, dest: Destination) -> None:
        load_fp8_weight(self.config, part, dest.view(layer.weight, WEIGHT), None)

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        """Random N(0, std) weights quantized block by block (--load-format dummy), bias too."""
        w = torch.empty(layer.weight.shape, dtype=torch.float32, device=layer.weight.device)
        w.normal_(0.0, std, generator=generator)
        wq, scale = quantize_blocks(w, self.block)
        layer.weight.copy_(wq)
        layer.weight_scale_inv.copy_(scale)
        if layer.bias is not None:
            layer.bias.normal_(0.0, std, generator=generator)

    def finish_loading(self, layer: nn.Module) -> None:
        """On CUDA (or with the Triton kernels): the weight dequantized once into the model dtype
        (see the module docstring)."""
        if layer.weight.is_cuda or self.triton:
            self.dequantize(layer)

    def dequantize(self, layer: nn.Module) -> None:
        """Replace the e4m3 weight by weight x block scale in the model dtype; `apply` then runs a
        plain projection (and a Triton-built Linear's decode rows the bf16 decode-row GEMM, whose
        tiling was chosen from the same [N, K] shape)."""
        if layer.weight.dtype == FP8_DTYPE:
            dense = dequantize_blocks(layer.weight, layer.weight_scale_inv, self.block, self.dtype)
            layer.weight = nn.Parameter(dense, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= self.decode_max_rows and x.stride(-1) == 1:
            return self._decode_linear(x, layer.weight, layer.bias, self.decode_config, silu_mul=layer.act is not None)
        if layer.weight.dtype != FP8_DTYPE:  # dequantized at load
            y = F.linear(x, layer.weight, layer.bias)
        elif x.shape[0] == 0:
            y = torch.empty((0, layer.weight.shape[0]), dtype=x.dtype, device=x.device)
        else:
            y = fp8_block_linear_reference(x, layer.weight, layer.weight_scale_inv, layer.bias, self.block)
        return y if layer.act is None else layer.act.forward(y)


def load_block_scales(layer: nn.Module, name: str, part: CheckpointPart, dest: Destination) -> None:
    """One checkpoint tensor's block scales ([ceil(rows / bn), ceil(K / bk)], this rank's block
    rows or block columns) into their place; the layers and the experts share it."""
    view = dest.view(getattr(layer, name), part.sharding)
    got = part.read()
    if tuple(got.shape) != tuple(view.shape):
        block = [part.sharding.out_block, part.sharding.in_block]
        raise ValueError(f"has shape {tuple(got.shape)}, expected {tuple(view.shape)}: one scale per {block} block "
                         f"of this rank's [{dest.rows[1]}, K] weight")
    view.copy_(got.float())
