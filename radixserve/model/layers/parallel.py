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

Every weight format shards through the same loaders: the layer says which part of a checkpoint
weight the rank holds (`checkpoint_place`: its output rows, or its input columns), the format
declares per parameter which dims follow those cuts (radixserve.model.layers.param_sharding), and
the cut of each tensor follows. So for FP8 (radixserve.model.layers.fp8): column-parallel, the
e4m3 rows with their per-row scales (a per-tensor scale applies to every row; replicated KV
heads' rows included); row-parallel, every output row with its whole scale and this rank's input
columns of the e4m3 weight. Quantized at load, a row-parallel rank reads the whole tensor once to
take each row's max |w| over all columns, so every rank's scale, and each e4m3 value, is tp 1's.
Block-wise FP8 (`weight_scale_inv` per bn x bk block): a rank's rows or input columns start and
end on the block grid (radixserve.model.quantization.check_block_alignment refuses any other
tp size), so it reads the block rows or block columns of its part, and since activations are
quantized per bk columns, its o_proj and down_proj inputs round exactly as tp 1's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import TensorParallel
from radixserve.model.layers.activation import SiluAndMul
from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.layers.linear import Linear, MergedLinear, ShardId, copy_weight
from radixserve.model.layers.param_sharding import Cut, Destination, Loaded, Span, read_all, read_cols, read_rows, \
    shape_of
from radixserve.model.quantization import Fp8Config

__all__ = ["ColumnParallelLinear", "Loaded", "ParallelLMHead", "RowParallelLinear", "VocabParallelEmbedding",
           "read_all", "read_cols", "read_rows", "shape_of"]


class ColumnParallelLinear(MergedLinear):
    """A MergedLinear holding, for each shard, rows [start, start + size) of its checkpoint tensor.
    `shards`: {shard id: (start row in the checkpoint tensor, rows this rank holds)}."""

    reads_slices = True

    def __init__(self, input_size: int, shards: dict[ShardId, tuple[int, int]], *, bias: bool, dtype: torch.dtype,
                 kernels: KernelChoice, act: Optional[SiluAndMul] = None, fp8: Optional[Fp8Config] = None):
        super().__init__(input_size, {k: size for k, (_, size) in shards.items()}, bias=bias, dtype=dtype,
                         kernels=kernels, act=act, fp8=fp8)
        self.source_rows = dict(shards)

    def checkpoint_place(self, shard_id: Optional[ShardId]) -> tuple[Cut, Destination]:
        _, dest = super().checkpoint_place(shard_id)
        start, size = self.source_rows[shard_id]
        return Cut(rows=Span(start, size)), dest


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
        y = self.quant_method.apply(self, x)
        return self.tp.all_reduce(y) if self.reduce else y

    def checkpoint_place(self, shard_id: Optional[ShardId]) -> tuple[Cut, Destination]:
        _, dest = super().checkpoint_place(shard_id)
        return Cut(cols=Span(self.start, self.input_size)), dest


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
        return self.tp.all_gather_last_dim(self.quant_method.apply(self, x))[:, :self.vocab_size]

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[ShardId] = None) -> None:
        if param != "weight" or shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no {param!r} shard {shard_id!r}")
        _load_vocab_rows(self.weight, loaded, self.start, self.real)
