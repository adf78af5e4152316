"""FP8 (e4m3) projections: what a `Linear` delegates to when the model runs FP8 weights.

The weight is e4m3 [N, K] with one float32 scale per output row (`weight_scale` [N]): a per-tensor
checkpoint scale is expanded over its tensor's rows, so the shards of a fused q|k|v or gate|up
(whose per-tensor scales differ) need no requantization. Activations get a scale per token
(dynamic: max |x| of the row / 448) or the checkpoint's per-tensor `input_scale` (static; a fused
projection takes the largest of its shards', as the activation is one tensor). Block-wise
checkpoints (one scale per block of the weight) are radixserve.model.layers.fp8_block's.

Under tensor parallelism (radixserve.model.layers.parallel) a column-parallel shard holds its
output rows with their scales, so its rows are tp 1's; a row-parallel shard holds every output row
with the whole row's scale and a slice of the input columns (quantized at load, the scale comes
from the whole row, so the e4m3 values are tp 1's too). Its activations are quantized per token
over the rank's own slice of them: a rank's scale is the max |x| of its slice, not of the whole
row, which rounds a little differently from tp 1 (within the FP8 tolerance; a static
`input_scale` is the same on every rank).

How each parameter shards (radixserve.model.layers.param_sharding): `weight` by rows and columns,
`weight_scale` by rows or, one value per checkpoint tensor, whole; `input_scale` replicated (one
value per checkpoint tensor, kept per fused shard); `bias` by rows.

Activations come as a tensor, quantized here in front of the GEMM, or already quantized per token
as `Fp8Activations`: with the Triton kernels and dynamic activation scales, the RMSNorm in front
of q|k|v and of gate|up writes e4m3 values and their scales itself (radixserve.kernels.norm,
`rms_norm_fp8`; `Linear.takes_fp8_activations` says which projections take them), bit for bit
what quantizing its bf16 output here would give; o_proj and down_proj quantize their input here.

Paths, picked per call from the input:
- CUDA, M <= FP8_DECODE_ROWS_FACTOR x the decode-row limit with the Triton kernels:
  the weight-streaming decode GEMM's FP8 variant (radixserve.kernels.decode_linear_fp8): the
  activations quantized per token as below (unless they come quantized), then e4m3 x e4m3, both
  scales applied in the epilogue. Decode reads the weights once, so half the bytes is less time.
- CUDA, capability 8.9+ (Ada, Hopper): activations quantized (with the Triton kernels, in one
  kernel: radixserve.kernels.quant_fp8; or by the norm before), then `torch._scaled_mm`
  (cuBLASLt FP8 tensor cores, row-wise scales).
- Elsewhere (the CPU reference): activations quantized and dequantized the same way, the weight
  dequantized, then an fp32 matmul.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from radixserve.model.layers.kernel_choice import KernelChoice, decode_gemm_plan
from radixserve.model.layers.param_sharding import (FP8_DTYPE, REPLICATED, ROWS, ROWS_OR_ONE, WEIGHT, CheckpointPart,
                                                     Destination, ParamSpec)
from radixserve.model.quantization import Fp8Config

FP8_MAX = 448.0  # the largest finite e4m3fn value
# A row of zeros gets this scale instead of 0, so quantizing it divides by something finite.
MIN_SCALE = 1e-12
# FP8 projections run the decode-row GEMM up to this many times `decode_gemm_max_rows` rows.
FP8_DECODE_ROWS_FACTOR = 2


class Fp8Activations(NamedTuple):
    """Activations quantized per token, as an FP8 projection multiplies them: `values` e4m3 [M, K],
    `scales` float32 [M, 1] (row i stands for values[i] * scales[i]); the projection returns `dtype`."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """float32 [M]: the scale that maps each row's largest |value| to 448."""
    return (x.abs().amax(dim=-1).float() / FP8_MAX).clamp_min(MIN_SCALE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M]): each row scaled so its largest |value| maps to 448."""
    scale = row_scales(x)
    return quantize_with(x, scale[:, None]), scale


def quantize_with(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 of x / scale, saturated at +-448 (scale broadcasts against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activations(x: torch.Tensor, input_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, 1]): per token, or the static per-tensor scale."""
    if input_scale is None:
        # Times the reciprocal, not a division: torch divides by a scalar that way on CUDA and not
        # on the CPU, so spelling it out gives one result on both, and the fused kernel matches it.
        scale = (x.abs().amax(dim=-1).float() * (1.0 / FP8_MAX)).clamp_min(MIN_SCALE)[:, None]
        return quantize_with(x, scale), scale
    return quantize_with(x, input_scale), input_scale.expand(x.shape[0], 1)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """What the FP8 tensor-core GEMM computes, in fp32: quantized activations times the
    dequantized weight, + bias; in x's dtype."""
    xq, x_scale = quantize_activations(x, input_scale)
    return fp8_linear_dequantized(xq, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_linear_dequantized(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale)^T (+ bias) in fp32, for e4m3 activations xq [M, K]
    with scales [M, 1]; in out_dtype."""
    w = weight.float() * weight_scale[:, None]
    y = (xq.float() * x_scale) @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _scaled_mm_ok(x: torch.Tensor, out_dtype: torch.dtype, weight: torch.Tensor) -> bool:
    # Row-wise scaled FP8 GEMMs write bf16.
    if not x.is_cuda or out_dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    # cuBLASLt's FP8 GEMM needs K and N in multiples of 16.
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], input_scale: Optional[torch.Tensor],
                         fused_quant: bool = False) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N])^T on the FP8 tensor cores. fused_quant:
    the activations are quantized by one Triton kernel (CUDA; the same e4m3 values and scales as
    the torch ops, in one launch instead of nine)."""
    if fused_quant:
        from radixserve.kernels.quant_fp8 import quantize_rows_fp8

        xq, x_scale = quantize_rows_fp8(x, input_scale)
    else:
        xq, x_scale = quantize_activations(x, input_scale)
    return fp8_scaled_mm(xq, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """e4m3 activations xq [M, K] with float32 scales [M, 1] times the e4m3 weight on the FP8
    tensor cores (`torch._scaled_mm`, row-wise scales), + bias, in out_dtype."""
    # weight.t() is a view (the column-major operand _scaled_mm wants); the scales are float32
    # already, and a per-token [M, 1] is contiguous: only a static scale's expand is copied. A bias
    # in the output dtype is added in the GEMM's epilogue (in float32, one launch fewer).
    in_gemm = bias is not None and bias.dtype == out_dtype
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.contiguous(), scale_b=weight_scale[None, :],
                         bias=bias if in_gemm else None, out_dtype=out_dtype)
    return y if bias is None or in_gemm else y + bias


class Fp8LinearMethod:
    """The FP8 weight format of one `Linear` (a MergedLinear's shards included).

    `create_weights` registers on the layer: `weight` e4m3 [N, K]; `weight_scale` float32 [N];
    with static activations `input_scale` float32 [number of shards]. Where the checkpoint holds
    them they are parameters (the loader requires them); quantized at load, `weight_scale` is a
    buffer the weight's loading fills. `triton`: the layer runs the Triton kernels (the activation
    quantization in front of the FP8 GEMM is then one kernel).
    """

    quantized = True

    def __init__(self, config: Fp8Config, num_shards: int, triton: bool = False):
        self.config = config
        self.num_shards = num_shards
        self.triton = triton
        # Set by finish_loading: None with per-token scales.
        self.static_scale: Optional[torch.Tensor] = None
        self.decode_max_rows = 0  # set by choose_kernels; 0: never the decode-row GEMM
        self.decode_config = None
        self._fp8_token_input = False
        self.params: dict[str, ParamSpec] = {}

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shared: Optional[nn.Parameter]) -> None:
        if shared is not None:
            raise ValueError("an FP8 projection cannot share another layer's weight")
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False)
        scale = torch.ones(output_size, dtype=torch.float32)
        self.params = {"weight": ParamSpec(WEIGHT, self._load_weight), "bias": ParamSpec(ROWS)}
        if self.config.from_checkpoint:
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            # One value per checkpoint tensor (expanded over its rows) or one per row.
            self.params["weight_scale"] = ParamSpec(ROWS_OR_ONE, load_row_scales)
        else:
            layer.register_buffer("weight_scale", scale)  # filled as the weight is quantized
        if self.config.static_activations:
            layer.input_scale = nn.Parameter(torch.ones(self.num_shards, dtype=torch.float32), requires_grad=False)
            self.params["input_scale"] = ParamSpec(REPLICATED, _load_input_scale)
        else:
            layer.register_parameter("input_scale", None)

    def choose_kernels(self, layer: nn.Module, kernels: KernelChoice) -> None:
        self.decode_max_rows, self.decode_config = decode_gemm_plan(kernels, layer.weight, layer.bias, layer.act)
        if self.decode_max_rows:
            from radixserve.kernels.decode_linear_fp8 import decode_linear_fp8

            self._decode_linear_fp8 = decode_linear_fp8
            # e4m3 tiles are half the bytes: on an H200 this GEMM beat cuBLASLt's FP8 GEMM (with its
            # activation quantization) up to twice bf16's limit
            # (docs/runs/2026-12-02-fp8-activations-agent-vs-fcfs.md).
            self.decode_max_rows *= FP8_DECODE_ROWS_FACTOR
        # Per-token FP8 activations from the layer before are what this projection would make of a
        # bf16 input itself: with the Triton kernels, on every path (the decode-row GEMM's default
        # "token_fp8" mode and cuBLASLt's FP8 GEMM quantize per token the same way).
        self._fp8_token_input = self.triton and (self.decode_config is None
                                                 or self.decode_config.fp8_mode == "token_fp8")

    def takes_fp8_activations(self, layer: nn.Module) -> bool:
        """Whether the layer in front may hand this projection `Fp8Activations` (per token) instead
        of a tensor: with the Triton kernels and dynamic activation scales (a static `input_scale`
        quantizes differently)."""
        return self._fp8_token_input and layer.input_scale is None

    # ------------------------------------------------------------------ loading
    def _load_weight(self, layer: nn.Module, name: str, part: CheckpointPart, dest: Destination) -> None:
        load_fp8_weight(self.config, part, dest.view(layer.weight, WEIGHT), dest.view(layer.weight_scale, ROWS))

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        """Random N(0, std) weights quantized per row (the --load-format dummy path), bias too."""
        w = torch.empty(layer.weight.shape, dtype=torch.float32, device=layer.weight.device)
        w.normal_(0.0, std, generator=generator)
        wq, scale = quantize_rows(w)
        layer.weight.copy_(wq)
        layer.weight_scale.copy_(scale)
        if layer.bias is not None:
            layer.bias.normal_(0.0, std, generator=generator)
        if layer.input_scale is not None:
            layer.input_scale.fill_(1.0)

    def finish_loading(self, layer: nn.Module) -> None:
        """Once every tensor is in: the static activation scale [1] of the fused projection."""
        self.static_scale = None if layer.input_scale is None else layer.input_scale.max().reshape(1)

    # ------------------------------------------------------------------ forward
    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        """x [M, K] @ the layer's weight^T (+ bias), then the layer's activation: x a tensor
        (quantized here, per token or with the static scale) or Fp8Activations (per token
        already: multiplied as they are). A decode step's few rows take the FP8 decode-row GEMM."""
        act = layer.act
        if isinstance(x, Fp8Activations):
            values = x.values
            if 0 < values.shape[0] <= self.decode_max_rows and values.stride(-1) == 1:
                return self._decode_linear_fp8(values, layer.weight, layer.weight_scale, layer.bias,
                                               self.decode_config, silu_mul=act is not None, x_scale=x.scales,
                                               out_dtype=x.dtype)
            y = self._apply_quantized(layer, x)
        elif 0 < x.shape[0] <= self.decode_max_rows and x.stride(-1) == 1:
            return self._decode_linear_fp8(x, layer.weight, layer.weight_scale, layer.bias, self.decode_config,
                                           silu_mul=act is not None, input_scale=self.static_scale)
        else:
            y = self._apply_tensor(layer, x)
        return y if act is None else act.forward(y)

    def _apply_tensor(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.empty((0, layer.weight.shape[0]), dtype=x.dtype, device=x.device)
        if _scaled_mm_ok(x, x.dtype, layer.weight):
            return fp8_linear_scaled_mm(x, layer.weight, layer.weight_scale, layer.bias, self.static_scale,
                                        fused_quant=self.triton and x.stride(-1) == 1)
        return fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias, self.static_scale)

    def _apply_quantized(self, layer: nn.Module, x: Fp8Activations) -> torch.Tensor:
        if layer.input_scale is not None:
            raise ValueError("a projection with a static input scale quantizes its input itself; it takes no "
                             "per-token FP8 activations")
        values = x.values
        if values.shape[0] == 0:
            return torch.empty((0, layer.weight.shape[0]), dtype=x.dtype, device=values.device)
        if _scaled_mm_ok(values, x.dtype, layer.weight):
            return fp8_scaled_mm(values, x.scales, layer.weight, layer.weight_scale, layer.bias, x.dtype)
        return fp8_linear_dequantized(values, x.scales, layer.weight, layer.weight_scale, layer.bias, x.dtype)


# --------------------------------------------------------------------------- loaders shared with the experts

def load_fp8_weight(config: Fp8Config, part: CheckpointPart, weight: torch.Tensor,
                    scale: Optional[torch.Tensor]) -> None:
    """An e4m3 weight's rows (`weight`, their float32 per-row scales `scale`) from a checkpoint
    tensor: copied from an FP8 checkpoint (the scales are tensors of their own), or quantized
    here per output row from a plain one. Each row's scale is taken over the whole row, so a
    row-parallel rank, holding some columns, reads every column of its rows once: its scales and
    each of its e4m3 values are tp 1's. Quantizing a fused weight's shard alone gives the rows
    quantizing the fused weight would."""
    if part.is_fp8:
        if not config.from_checkpoint:
            raise ValueError("is already FP8, but config.json declares no quantization_config")
        _copy(weight, part.read())
        return
    if config.from_checkpoint:
        raise ValueError(f"is {part.dtype_name}, but config.json declares FP8 weights ({config.source})")
    rows = part.read_rows().to(weight.device)
    cols = part.cols_of(rows)
    _check_shape(weight, cols)
    row_scale = row_scales(rows)
    weight.copy_(quantize_with(cols, row_scale[:, None]))
    scale.copy_(row_scale)


def load_row_scales(layer: nn.Module, name: str, part: CheckpointPart, dest: Destination) -> None:
    """A checkpoint's weight scale into its rows' float32 scales: one value per tensor (every row
    of it gets it) or one per output row ([N] or [N, 1])."""
    rows = dest.view(getattr(layer, name), part.sharding)
    flat = part.read().reshape(-1).float()
    if flat.numel() == 1:
        rows.fill_(float(flat[0]))
    elif flat.numel() == rows.numel():
        rows.copy_(flat)
    else:
        raise ValueError(f"has shape {part.shape}: a weight scale is one value or one per output row "
                         f"({rows.numel()} here); block-wise scales are `weight_scale_inv` under a "
                         "weight_block_size")


def _load_input_scale(layer: nn.Module, name: str, part: CheckpointPart, dest: Destination) -> None:
    """A static input scale: one value per checkpoint tensor, kept per shard (the fused
    projection's activations take the largest, `finish_loading`)."""
    value = part.read()
    if value.numel() != 1:
        raise ValueError(f"has shape {tuple(value.shape)}: a static input scale is one value per tensor")
    getattr(layer, name)[dest.shard] = float(value.reshape(-1)[0])


def _check_shape(dest: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(dest.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(dest.shape)} from config.json")


def _copy(dest: torch.Tensor, loaded: torch.Tensor) -> None:
    _check_shape(dest, loaded)
    dest.copy_(loaded)
