"""Megatron-style tensor-parallel layers: each rank holds a slice of a weight and reads only that
slice from the checkpoint (a safetensors slice is read lazily, so no rank reads a whole tensor).

- `ColumnParallelLinear`: a fused projection (q|k|v, gate|up) whose every shard keeps this rank's
  output rows; the output stays split (this rank's heads, this rank's MLP columns).
- `RowParallelLinear`: this rank's input columns; the partial products are summed over the ranks
  with one all-reduce (o_proj, down_proj).
- `VocabParallelEmbedding` / `ParallelLMHead`: the vocabulary split in row blocks; the embedding
  sums the one rank's row with everyone else's zeros (an all-reduce), the LM head gathers every
  rank's logits so sampling sees the whole vocabulary.

A checkpoint tensor arrives as a torch.Tensor or as a safetensors slice (`get_slice`); both index
the same way.

FP8 projections (`fp8`, radixserve.model.layers.fp8) shard the same way. Column-parallel: the
e4m3 rows and their per-row scales (a per-tensor scale applies to every row; a per-channel one is
sliced with the rows, replicated KV heads' rows included). Row-parallel: every output row with its
whole scale, this rank's input columns of the e4m3 weight. Quantized at load, a row-parallel rank
reads the whole tensor once to take each row's max |w| over all columns, so every rank's scale,
and each e4m3 value, is tp 1's.

Block-wise FP8 (`weight_scale_inv` per bn x bk block): a rank's rows or input columns start and
end on the block grid (radixserve.model.quantization.check_block_alignment refuses any other
tp size), so it reads the block rows or block columns of its part, and since activations are
quantized per bk columns, its o_proj and down_proj inputs round exactly as tp 1's.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import TensorParallel
from radixserve.model.layers.activation import SiluAndMul
from radixserve.model.layers.fp8 import FP8_DTYPE, row_scales
from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.layers.linear import Linear, MergedLinear, ShardId, copy_weight
from radixserve.model.quantization import Fp8Config

# A checkpoint tensor or a lazily read safetensors slice of one.
Loaded = Any


def read_rows(loaded: Loaded, start: int, size: int) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(0, start, size)
    return loaded[start:start + size]


def read_cols(loaded: Loaded, start: int, size: int) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(1, start, size)
    return loaded[:, start:start + size]


def read_all(loaded: Loaded) -> torch.Tensor:
    return loaded[...]


def shape_of(loaded: Loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_scale_rows(loaded: Loaded, start: int, size: int) -> torch.Tensor:
    """An FP8 weight scale for rows [start, start + size): a per-tensor scale whole, a per-channel
    one ([N] or [N, 1]) sliced like the weight's rows."""
    shape = shape_of(loaded)
    if math.prod(shape) == 1:
        return read_all(loaded)
    if not shape or shape[0] < start + size or math.prod(shape[1:]) != 1:
        raise ValueError(f"has shape {shape}: a weight scale is one value or one per output row (this rank "
                         f"reads rows {start}..{start + size - 1}); block-wise scales are "
                         "`weight_scale_inv` under a weight_block_size")
    return read_rows(loaded, start, size)


class ColumnParallelLinear(MergedLinear):
    """A MergedLinear holding, for each shard, rows [start, start + size) of its checkpoint tensor.
    `shards`: {shard id: (start row in the checkpoint tensor, rows this rank holds)}."""

    reads_slices = True

    def __init__(self, input_size: int, shards: dict[ShardId, tuple[int, int]], *, bias: bool, dtype: torch.dtype,
                 kernels: KernelChoice, act: Optional[SiluAndMul] = None, fp8: Optional[Fp8Config] = None):
        super().__init__(input_size, {k: size for k, (_, size) in shards.items()}, bias=bias, dtype=dtype,
                         kernels=kernels, act=act, fp8=fp8)
        self.source_rows = dict(shards)

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[ShardId] = None) -> None:
        if shard_id not in self.source_rows:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r} (shards: {list(self.source_rows)})")
        start, size = self.source_rows[shard_id]
        local_start, _ = self.shard_rows[shard_id]
        if self.quant is not None:
            if param == "weight_scale":
                part = read_scale_rows(loaded, start, size)
            elif param == "weight_scale_inv":  # block-wise: the block rows of this rank's rows
                bn = self.quant.config.block[0]
                part = read_rows(loaded, start // bn, -(-size // bn))
            elif param == "input_scale":  # one value per checkpoint tensor, the same on every rank
                part = read_all(loaded)
            else:
                part = read_rows(loaded, start, size)
            self.quant.load(self, param, part, shard_id, (local_start, size))
            return
        dest = getattr(self, param).narrow(0, local_start, size)
        copy_weight(dest, read_rows(loaded, start, size))


class RowParallelLinear(Linear):
    """Input columns [start, start + input_size) of the checkpoint weight; the output is summed over
    the ranks. Without a bias (a bias would be added once, after the sum: Qwen2 has none here).
    `reduce=False`: the output stays this rank's partial sum, for a caller that adds it to other
    partial sums and all-reduces them once (a mixture-of-experts layer's shared expert)."""

    reads_slices = True

    def __init__(self, input_size: int, output_size: int, *, start: int, dtype: torch.dtype, kernels: KernelChoice,
                 tp: TensorParallel, fp8: Optional[Fp8Config] = None, reduce: bool = True):
        super().__init__(input_size, output_size, bias=False, dtype=dtype, kernels=kernels, fp8=fp8)
        self.start = start
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.tp.all_reduce(y) if self.reduce else y

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[ShardId] = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if self.quant is None:
            copy_weight(self.weight, read_cols(loaded, self.start, self.input_size))
        elif param != "weight" or self.quant.config.from_checkpoint or _is_fp8(loaded):
            # Scales cover every output row, all of which this rank holds; the e4m3 weight its columns
            # (block-wise scales: the block columns of its columns).
            if param == "weight":
                part = read_cols(loaded, self.start, self.input_size)
            elif param == "weight_scale_inv":
                bk = self.quant.config.block[1]
                part = read_cols(loaded, self.start // bk, -(-self.input_size // bk))
            else:
                part = read_all(loaded)
            self.quant.load(self, param, part, None, (0, self.output_size))
        else:
            self._quantize_columns(read_all(loaded))

    def _quantize_columns(self, full: torch.Tensor) -> None:
        """Quantize this rank's columns of a plain weight with each row's scale over all its columns
        (tp 1's scale; every rank computes the same one)."""
        if full.dim() != 2 or full.shape[1] < self.start + self.input_size:
            raise ValueError(f"has shape {tuple(full.shape)}, expected ({self.output_size}, K >= "
                             f"{self.start + self.input_size}) from config.json")
        full = full.to(self.weight.device)
        self.quant.load(self, "weight", full.narrow(1, self.start, self.input_size), None, (0, self.output_size),
                        row_scale=row_scales(full))


def _is_fp8(loaded: Loaded) -> bool:
    if isinstance(loaded, torch.Tensor):
        return loaded.dtype == FP8_DTYPE
    return loaded.get_dtype() == "F8_E4M3"


def _load_vocab_rows(weight: torch.Tensor, loaded: Loaded, start: int, real: int) -> None:
    """This rank's vocabulary rows; its padding rows (past the vocabulary) are zero."""
    if real:
        copy_weight(weight.narrow(0, 0, real), read_rows(loaded, start, real))
    weight[real:].zero_()


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; ids outside them give zeros, summed over ranks."""

    reads_slices = True

    def __init__(self, vocab_size: int, hidden_size: int, *, start: int, rows: int, real: int, dtype: torch.dtype,
                 tp: TensorParallel):
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.rows, self.real = start, rows, real
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # every id is this rank's: no masking, nothing to sum
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[ShardId] = None) -> None:
        if param != "weight" or shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no {param!r} shard {shard_id!r}")
        _load_vocab_rows(self.weight, loaded, self.start, self.real)


class ParallelLMHead(Linear):
    """This rank's vocabulary rows of the LM head; the logits of all ranks are gathered, padding cut."""

    reads_slices = True

    def __init__(self, hidden_size: int, vocab_size: int, *, start: int, rows: int, real: int, dtype: torch.dtype,
                 kernels: KernelChoice, tp: TensorParallel, weight: Optional[nn.Parameter] = None):
        super().__init__(hidden_size, rows, bias=False, dtype=dtype, kernels=kernels, weight=weight)
        self.vocab_size = vocab_size
        self.start, self.real = start, real
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last_dim(super().forward(x))[:, :self.vocab_size]

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[ShardId] = None) -> None:
        if param != "weight" or shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no {param!r} shard {shard_id!r}")
        _load_vocab_rows(self.weight, loaded, self.start, self.real)
