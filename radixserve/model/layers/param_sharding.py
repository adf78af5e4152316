"""How a parameter's checkpoint tensor is cut for one tensor-parallel rank: declared per parameter
by the weight format that owns it (radixserve.model.layers.quant_method), read by one loader.

A projection's weight has two axes: its output rows and its input columns. A column-parallel rank
holds some output rows (its q|k|v heads, its gate|up columns, its slice of every expert's
intermediate), a row-parallel rank some input columns (o_proj, down_proj, the experts' down
weights); a layer says which with a `Cut`. Every parameter declares (`ParamSharding`) which dim
of its checkpoint tensor runs along each axis and how many rows or columns one element stands
for, so the cut of any parameter follows from the weight's:

| declaration | out dim | in dim | e.g. |
|---|---|---|---|
| `WEIGHT` | 0 (rows) | 1 (columns) | a weight |
| `ROWS` | 0 | - | a bias |
| `ROWS_OR_ONE` | 0, or one value for the whole tensor | - | a per-channel or per-tensor weight scale |
| `REPLICATED` | - | - | a static input scale: every rank reads it whole |
| `blocks(bn, bk)` | 0, bn rows an element | 1, bk columns an element | a block-wise weight scale |

A dim the cut does not touch is read whole, so under a row-parallel cut a bias or a row scale
is every row's, and under a column-parallel one a block scale has every block column. Block cuts
start on the block grid (radixserve.model.quantization.check_block_alignment and
radixserve.model.moe_config.check_expert_blocks refuse every other tp size); a tensor's last
block may be partial (ceil(rows / bn) block rows).

Where a checkpoint tensor lands is a `Destination`: its rows among the layer's output rows (a
fused q|k|v or gate|up shard's), the shard's position (for one value per shard), and for stacked
experts the expert. The same declaration cuts the destination's view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

# A checkpoint tensor, or a lazily read safetensors slice of one (indexing reads only that part).
Loaded = Any
FP8_DTYPE = torch.float8_e4m3fn
_SAFETENSORS_FP8 = "F8_E4M3"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shape_of(loaded: Loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


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


def copy_weight(dest: torch.Tensor, loaded: torch.Tensor) -> None:
    """dest <- loaded (cast to dest's dtype and device); ValueError when the shapes differ, or when
    an FP8 tensor would be cast (without its scale it is not the weight)."""
    if loaded.dtype == FP8_DTYPE and dest.dtype != loaded.dtype:
        raise ValueError("is FP8, but this parameter is not (an FP8 checkpoint needs its quantization_config in "
                         "config.json)")
    if tuple(loaded.shape) != tuple(dest.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(dest.shape)} from config.json")
    dest.copy_(loaded)


@dataclass(frozen=True)
class ParamSharding:
    """Which dim of a parameter's checkpoint tensor runs along the layer's output rows (`out_dim`)
    and which along its input columns (`in_dim`), None for neither, with the rows (`out_block`)
    and columns (`in_block`) one element stands for. `one_value`: a tensor of a single value
    stands for every row (a per-tensor scale) and is read whole."""

    out_dim: Optional[int] = None
    in_dim: Optional[int] = None
    out_block: int = 1
    in_block: int = 1
    one_value: bool = False


WEIGHT = ParamSharding(out_dim=0, in_dim=1)
ROWS = ParamSharding(out_dim=0)
ROWS_OR_ONE = ParamSharding(out_dim=0, one_value=True)
REPLICATED = ParamSharding()


def blocks(bn: int, bk: int) -> ParamSharding:
    """A scale per bn x bk block of the weight: block rows along the output, block columns along the input."""
    return ParamSharding(out_dim=0, in_dim=1, out_block=bn, in_block=bk)


@dataclass(frozen=True)
class Span:
    """[start, start + size) of an axis of the checkpoint weight; `total`, where the layer knows
    it, is the axis's whole length, which the checkpoint tensor must have."""

    start: int
    size: int
    total: Optional[int] = None


@dataclass(frozen=True)
class Cut:
    """The part of a checkpoint weight a rank holds: its output rows and its input columns (None: all)."""

    rows: Optional[Span] = None
    cols: Optional[Span] = None


WHOLE = Cut()


class CheckpointPart:
    """One checkpoint tensor (whole, or a lazy safetensors slice) with the part of it that this
    rank reads, from its parameter's declaration and the layer's cut."""

    def __init__(self, loaded: Loaded, sharding: ParamSharding, cut: Cut):
        self.loaded, self.sharding, self.cut = loaded, sharding, cut

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self.loaded)

    @property
    def is_fp8(self) -> bool:
        if isinstance(self.loaded, torch.Tensor):
            return self.loaded.dtype == FP8_DTYPE
        return self.loaded.get_dtype() == _SAFETENSORS_FP8

    @property
    def dtype_name(self) -> str:
        return str(self.loaded.dtype) if isinstance(self.loaded, torch.Tensor) else self.loaded.get_dtype()

    def read(self) -> torch.Tensor:
        """This rank's part: its rows and its columns, as the declaration cuts them."""
        return self._read(rows=True, cols=True)

    def read_rows(self) -> torch.Tensor:
        """This rank's rows with every column (a row's scale is taken over the whole row, so a
        row-parallel rank reads the whole tensor); `cols_of` then takes its columns."""
        return self._read(rows=True, cols=False)

    def cols_of(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a tensor `read_rows` returned."""
        s = self.sharding
        if self.cut.cols is None or s.in_dim is None:
            return rows
        start, size = self._bounds(tuple(rows.shape), s.in_dim, s.in_block, self.cut.cols, "input columns")
        return rows.narrow(s.in_dim, start, size)

    def _read(self, *, rows: bool, cols: bool) -> torch.Tensor:
        s, shape = self.sharding, self.shape
        if s.one_value and math.prod(shape) == 1:
            return read_all(self.loaded)
        index: list[slice] = [slice(None)] * len(shape)
        for use, dim, block, span, what in ((rows, s.out_dim, s.out_block, self.cut.rows, "output rows"),
                                            (cols, s.in_dim, s.in_block, self.cut.cols, "input columns")):
            if use and dim is not None and span is not None:
                start, size = self._bounds(shape, dim, block, span, what)
                index[dim] = slice(start, start + size)
        if all(i == slice(None) for i in index):
            return read_all(self.loaded)
        if isinstance(self.loaded, torch.Tensor):
            out = self.loaded
            for dim, i in enumerate(index):
                if i != slice(None):
                    out = out.narrow(dim, i.start, i.stop - i.start)
            return out
        return self.loaded[tuple(index)]

    @staticmethod
    def _bounds(shape: tuple[int, ...], dim: int, block: int, span: Span, what: str) -> tuple[int, int]:
        """(first element, elements) of `span` along `dim`, each element `block` rows or columns."""
        start, size = span.start // block, _cdiv(span.size, block)
        unit = "" if block == 1 else f" in blocks of {block}"
        if dim >= len(shape):
            raise ValueError(f"has shape {shape}: expected {what} along dim {dim}")
        if span.total is not None and shape[dim] != _cdiv(span.total, block):
            raise ValueError(f"has shape {shape}, expected {_cdiv(span.total, block)} along dim {dim} "
                             f"({span.total} {what}{unit}) from config.json")
        if shape[dim] < start + size:
            raise ValueError(f"has shape {shape}: this rank reads {what} {start}..{start + size - 1}{unit} "
                             f"along dim {dim}")
        return start, size


@dataclass(frozen=True)
class Destination:
    """Where a checkpoint tensor lands in its layer: `rows` (start, size) of the layer's output
    rows (a fused shard's rows; a row-parallel layer's are all of them), `shard` the position of
    its shard among the layer's (one value per shard: a static input scale), `expert` the index of
    a stacked expert parameter (None: not stacked)."""

    rows: tuple[int, int]
    shard: int = 0
    expert: Optional[int] = None

    def view(self, param: torch.Tensor, sharding: ParamSharding) -> torch.Tensor:
        """The part of `param` this tensor fills (its rows along the declaration's output dim)."""
        target = param if self.expert is None else param[self.expert]
        if sharding.out_dim is None:
            return target
        start, size = self.rows
        return target.narrow(sharding.out_dim, start // sharding.out_block, _cdiv(size, sharding.out_block))


# Fills parameter `name` of `layer` from `part` at `dest`.
ParamLoader = Callable[[nn.Module, str, CheckpointPart, Destination], None]


def copy_part(layer: nn.Module, name: str, part: CheckpointPart, dest: Destination) -> None:
    """The default loader: this rank's part copied as it is into its place."""
    copy_weight(dest.view(getattr(layer, name), part.sharding), part.read())


@dataclass(frozen=True)
class ParamSpec:
    """One checkpoint parameter of a weight format: how it shards, and what loads it (`copy_part`
    unless the format converts it: quantizing at load, expanding a per-tensor scale)."""

    sharding: ParamSharding
    load: ParamLoader = copy_part


def load_param(layer: nn.Module, params: Mapping[str, ParamSpec], name: str, loaded: Loaded, cut: Cut,
               dest: Destination) -> None:
    """Checkpoint tensor `loaded` into parameter `name` of `layer`, whose format declares `params`."""
    spec = params.get(name)
    if spec is None:
        raise ValueError(f"{type(layer).__name__} has no checkpoint parameter {name!r} (it has {sorted(params)})")
    spec.load(layer, name, CheckpointPart(loaded, spec.sharding, cut), dest)
