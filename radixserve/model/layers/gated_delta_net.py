"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5 (linear attention): one input projection,
a short causal conv over q|k|v, the gated delta rule over a per-request recurrent state, a gated
RMSNorm and the output projection. See radixserve.model.layers.gated_delta for the math.

Parameters, this rank's heads only under tensor parallelism (key heads and their value-head
groups split evenly; the checkpoint is read in slices):

- `in_proj`: one GEMM whose output rows are [q | k | v | z | b | a] for this rank's heads
  (q, k: key heads x k_head_dim; v, z: value heads x v_head_dim; b, a: one per value head).
  Qwen3.5 stores them as in_proj_qkv (q, k and v of all heads, each block whole), in_proj_z,
  in_proj_b, in_proj_a; Qwen3-Next as in_proj_qkvz and in_proj_ba, interleaved per key head
  ([q, k, v-group, z-group] and [b-group, a-group]): both load into the same layout.
- `conv1d.weight` [channels, kernel] over q|k|v's channels in that order; `A_log`, `dt_bias`
  per value head; `norm.weight` [v_head_dim] (replicated); `out_proj` row-parallel over the
  value channels, ending in the all-reduce.

The state lives in the pool of the batch (`batch.kv_pool.state`, one conv window and one
recurrent state per request row and linear layer); `LinearAttentionBatch` says, once per
forward pass, which rows the batch's sequences use and whether each continues its state.

States kept on the way (`ForwardBatch.state_captures`: the prefix cache keeps a sequence's state
after some of its new tokens, a checkpoint inside its prompt piece): the sequence mixing runs in
rounds, each sequence cut at its capture points, round r taking every sequence's r-th part on the
state the round before left in its row; after each round the states of the sequences cut there
are copied into their snapshot slots (`batch.kv_pool.snapshots`). The projections, the norm and
the output projection still run once over every token. Only the rounds' extra launches cost (a
few per layer and round, on the GPU), and each round's parts are shorter, so fla's chunked kernel
sees sequences that end inside a 64-token chunk (exact on the CPU's torch path; on the GPU the
same question as any resume point inside a chunk).
Kernels: Triton on CUDA in bf16/fp16 (radixserve.kernels.gated_delta; chunked prefill through
flash-linear-attention when it is installed), torch elsewhere; the torch path's decode step
reads no host values either, so a decode CUDA graph can hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.distributed import TensorParallel
from radixserve.model.layers.gated_delta import (causal_conv1d, chunk_gated_delta_rule, gdn_gates,
                                                 recurrent_gated_delta_rule, recurrent_step)
from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.layers.linear import MergedLinear, copy_weight
from radixserve.model.layers.norm import gated_rms_norm
from radixserve.model.layers.parallel import Loaded, RowParallelLinear, read_rows

# Prefill batches whose longest sequence has at least this many new tokens take fla's chunked
# kernel (when installed); shorter ones (decode rows, short chunks) the recurrent kernel.
CHUNKED_MIN_TOKENS = 64


@dataclass(frozen=True)
class LinearHeads:
    """This rank's share of a Gated DeltaNet layer: key heads [k_start, k_start + num_k), value
    heads [k_start * group, ...)."""
    num_k: int
    num_v: int
    k_start: int
    k_head_dim: int
    v_head_dim: int

    @property
    def group(self) -> int:
        return self.num_v // self.num_k

    @property
    def v_start(self) -> int:
        return self.k_start * self.group

    @property
    def key_dim(self) -> int:
        return self.num_k * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def linear_heads(num_k: int, num_v: int, k_head_dim: int, v_head_dim: int, tp_size: int, rank: int) -> LinearHeads:
    if num_k % tp_size:
        raise ValueError(f"linear_num_key_heads {num_k} is not divisible by tp_size {tp_size}")
    per_rank = num_k // tp_size
    return LinearHeads(per_rank, per_rank * (num_v // num_k), rank * per_rank, k_head_dim, v_head_dim)


@dataclass
class LinearAttentionBatch:
    """What every Gated DeltaNet layer of one forward pass needs to find its sequences' states."""
    decode: bool  # one token per sequence, no host lists (CUDA-graph capturable)
    state_rows: torch.Tensor  # [N] pool row of each sequence (padded graph rows: the scratch row)
    has_state: torch.Tensor  # [N] int64: 1 continues the row's state, 0 starts from zeros
    cu_seqlens: torch.Tensor  # [N + 1] int64
    # Prefill only (host lists and the conv kernel's tiles).
    rows_cpu: Optional[list[int]] = None
    has_state_cpu: Optional[list[bool]] = None
    lens_cpu: Optional[list[int]] = None
    conv_tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # Sequence index -> ascending (tokens of its new ones, snapshot slot): states to keep on the way.
    captures: Optional[dict[int, list[tuple[int, int]]]] = None

    @classmethod
    def of(cls, batch: ForwardBatch, scratch_row: int, *, triton: bool) -> "LinearAttentionBatch":
        device = batch.req_pool_indices.device
        has_state = (batch.prefix_lens > 0).to(torch.int64)
        if batch.mode is ForwardMode.DECODE:
            # Padded rows of a graph bucket (seq_len 0) point at request row 0: send their writes
            # to the scratch row instead.
            rows = torch.where(batch.seq_lens > 0, batch.req_pool_indices,
                               torch.full_like(batch.req_pool_indices, scratch_row))
            cu = torch.arange(rows.numel() + 1, dtype=torch.int64, device=device)
            return cls(True, rows, has_state, cu)
        lens = list(batch.extend_lens_cpu)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int64, device=device)
        torch.cumsum(batch.extend_lens, 0, out=cu[1:])
        meta = cls(False, batch.req_pool_indices, has_state, cu, rows_cpu=None,
                   has_state_cpu=[p > 0 for p in batch.prefix_lens_cpu], lens_cpu=lens)
        if triton:
            meta.conv_tiles = _device_conv_tiles(lens, device)
        else:
            meta.rows_cpu = batch.req_pool_indices.tolist()
        flat = batch.state_captures
        if flat:
            meta.captures = {}
            for i in range(0, len(flat), 3):
                meta.captures.setdefault(flat[i], []).append((flat[i + 1], flat[i + 2]))
            for points in meta.captures.values():
                points.sort()
            if meta.rows_cpu is None:
                meta.rows_cpu = batch.req_pool_indices.tolist()
        return meta

    @classmethod
    def of_parts(cls, rows: list[int], has_state: list[bool], lens: list[int], device: torch.device, *,
                 triton: bool) -> "LinearAttentionBatch":
        """A prefill batch of these sequences (pool rows, whether each continues its row's state,
        new tokens): one round of a batch cut at its capture points."""
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        rows_t, has_t = torch.tensor([rows, [int(h) for h in has_state]], dtype=torch.int64).to(device)
        meta = cls(False, rows_t, has_t, torch.tensor(cu, dtype=torch.int64).to(device), rows_cpu=list(rows),
                   has_state_cpu=list(has_state), lens_cpu=list(lens))
        if triton:
            meta.conv_tiles = _device_conv_tiles(lens, device)
        return meta


def _device_conv_tiles(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device copy of the conv kernel's tiles of a ragged batch (`gated_delta.conv_tiles`)."""
    from radixserve.kernels.gated_delta import conv_tiles

    seqs, starts = conv_tiles(lens)
    tiles = torch.tensor([seqs, starts], dtype=torch.int64).to(device, non_blocking=True)
    return tiles[0], tiles[1]


class GdnInProjection(MergedLinear):
    """[q | k | v | z | b | a] of this rank's heads in one weight, loaded from either checkpoint
    layout (see the module docstring). Shard ids: "qkv", "z", "b", "a" (Qwen3.5), "qkvz", "ba"
    (Qwen3-Next)."""

    reads_slices = True

    def __init__(self, hidden_size: int, heads: LinearHeads, full: LinearHeads, *, dtype: torch.dtype,
                 kernels: KernelChoice):
        self.heads, self.full = heads, full
        super().__init__(hidden_size, {"qkv": heads.conv_dim, "z": heads.value_dim, "b": heads.num_v,
                                       "a": heads.num_v}, bias=False, dtype=dtype, kernels=kernels)

    def qkv_source_rows(self) -> list[tuple[int, int, int]]:
        """(checkpoint row, local row, rows) of q, k and v in a whole-block [q | k | v] tensor
        (in_proj_qkv's rows, conv1d's channels)."""
        h, f = self.heads, self.full
        return [(h.k_start * h.k_head_dim, 0, h.key_dim),
                (f.key_dim + h.k_start * h.k_head_dim, h.key_dim, h.key_dim),
                (2 * f.key_dim + h.v_start * h.v_head_dim, 2 * h.key_dim, h.value_dim)]

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[Any] = None) -> None:
        if param != "weight":
            raise ValueError(f"{type(self).__name__} has no {param!r} (no bias, no FP8)")
        h = self.heads
        dest = self.weight
        zs, bs, as_ = (self.shard_rows[s][0] for s in ("z", "b", "a"))
        if shard_id == "qkv":
            for src, local, n in self.qkv_source_rows():
                copy_weight(dest.narrow(0, local, n), read_rows(loaded, src, n))
        elif shard_id == "z":
            copy_weight(dest.narrow(0, zs, h.value_dim), read_rows(loaded, h.v_start * h.v_head_dim, h.value_dim))
        elif shard_id in ("b", "a"):
            copy_weight(dest.narrow(0, bs if shard_id == "b" else as_, h.num_v), read_rows(loaded, h.v_start, h.num_v))
        elif shard_id == "qkvz":
            # Per key head: q (dk), k (dk), its group's v (g * dv), its group's z (g * dv).
            g_dv = h.group * h.v_head_dim
            width = 2 * h.k_head_dim + 2 * g_dv
            rows = read_rows(loaded, h.k_start * width, h.num_k * width)
            q, k, v, z = rows.reshape(h.num_k, width, -1).split([h.k_head_dim, h.k_head_dim, g_dv, g_dv], dim=1)
            for part, start in ((q, 0), (k, h.key_dim), (v, 2 * h.key_dim), (z, zs)):
                copy_weight(dest.narrow(0, start, part.shape[0] * part.shape[1]), part.reshape(-1, part.shape[-1]))
        elif shard_id == "ba":
            rows = read_rows(loaded, h.k_start * 2 * h.group, h.num_k * 2 * h.group)
            b, a = rows.reshape(h.num_k, 2 * h.group, -1).split([h.group, h.group], dim=1)
            copy_weight(dest.narrow(0, bs, h.num_v), b.reshape(h.num_v, -1))
            copy_weight(dest.narrow(0, as_, h.num_v), a.reshape(h.num_v, -1))
        else:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")


class DepthwiseConvWeight(nn.Module):
    """conv1d.weight, this rank's q|k|v channels, as [channels, kernel] (the checkpoint's [C, 1, K])."""

    reads_slices = True

    def __init__(self, proj: GdnInProjection, kernel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(proj.heads.conv_dim, kernel, dtype=dtype))
        object.__setattr__(self, "_proj", proj)  # for its channel ranges; not a submodule

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[Any] = None) -> None:
        if param != "weight" or shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no {param!r} shard {shard_id!r}")
        for src, local, n in self._proj.qkv_source_rows():
            part = read_rows(loaded, src, n)
            copy_weight(self.weight.narrow(0, local, n), part.reshape(n, -1))


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer; `linear_id` is its index among the model's linear layers (its
    place in the state pool)."""

    reads_slices = True  # A_log and dt_bias: this rank's value heads

    def __init__(self, hidden_size: int, full: LinearHeads, conv_kernel: int, eps: float, linear_id: int, *,
                 dtype: torch.dtype, kernels: KernelChoice, tp: TensorParallel):
        super().__init__()
        self.linear_id = linear_id
        self.full = full
        self.heads = h = linear_heads(full.num_k, full.num_v, full.k_head_dim, full.v_head_dim, tp.size, tp.rank)
        self.in_proj = GdnInProjection(hidden_size, h, full, dtype=dtype, kernels=kernels)
        self.conv1d = DepthwiseConvWeight(self.in_proj, conv_kernel, dtype)
        self.A_log = nn.Parameter(torch.empty(h.num_v, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(h.num_v, dtype=dtype))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(h.v_head_dim, dtype=dtype))
        self.eps = eps
        self.out_proj = RowParallelLinear(h.value_dim, hidden_size, start=h.v_start * h.v_head_dim, dtype=dtype,
                                          kernels=kernels, tp=tp)
        self.triton = kernels.triton
        if kernels.triton:
            from radixserve.kernels import fla_gdn, gated_delta

            self._kernels, self._fla = gated_delta, fla_gdn

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[Any] = None) -> None:
        if param not in ("A_log", "dt_bias") or shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no {param!r} shard {shard_id!r}")
        copy_weight(getattr(self, param), read_rows(loaded, self.heads.v_start, self.heads.num_v))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, meta: LinearAttentionBatch) -> torch.Tensor:
        h = self.heads
        proj = self.in_proj.forward(x)
        t = proj.shape[0]
        c, vd = h.conv_dim, h.value_dim
        mixed, z = proj[:, :c], proj[:, c:c + vd]
        b, a = proj[:, c + vd:c + vd + h.num_v], proj[:, c + vd + h.num_v:]
        pool = batch.kv_pool.state
        conv_states, states = pool.conv[self.linear_id], pool.ssm[self.linear_id]
        if meta.captures:
            core = self._mix_in_rounds(mixed, a, b, conv_states, states, meta, batch.kv_pool.snapshots)
        else:
            core = self._mix(mixed, a, b, conv_states, states, meta)
        normed = gated_rms_norm(core.reshape(t * h.num_v, h.v_head_dim), z.reshape(t * h.num_v, h.v_head_dim),
                                self.norm.weight, self.eps)
        return self.out_proj.forward(normed.view(t, vd))

    def _mix(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
             states: torch.Tensor, meta: LinearAttentionBatch) -> torch.Tensor:
        """The conv and the gated delta rule of the batch's tokens, on and into their rows' states."""
        if self.triton:
            return self._triton_forward(mixed, a, b, conv_states, states, meta)
        if meta.decode:
            return self._torch_decode(mixed, a, b, conv_states, states, meta)
        return self._torch_extend(mixed, a, b, conv_states, states, meta)

    def _mix_in_rounds(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                       states: torch.Tensor, meta: LinearAttentionBatch, snapshots) -> torch.Tensor:
        """`_mix`, each sequence cut at its capture points (see the module docstring): round r runs
        every sequence's r-th part, then copies the states of the sequences cut there into their
        snapshot slots."""
        assert not meta.decode and snapshots is not None, "states are captured in prefill batches only"
        # Per sequence: its token offset in the batch, its parts' bounds, the slot after each part.
        starts, parts = [], []
        offset = 0
        for i, n in enumerate(meta.lens_cpu):
            points = [(at, slot) for at, slot in (meta.captures.get(i) or ()) if 0 < at < n]
            starts.append(offset)
            parts.append(([0] + [at for at, _ in points] + [n], [slot for _, slot in points]))
            offset += n
        out = torch.empty(mixed.shape[0], self.heads.num_v, self.heads.v_head_dim, dtype=mixed.dtype,
                          device=mixed.device)
        snap_conv, snap_ssm = snapshots.conv[self.linear_id], snapshots.ssm[self.linear_id]
        for r in range(max(len(bounds) - 1 for bounds, _ in parts)):
            members = [i for i, (bounds, _) in enumerate(parts) if len(bounds) - 1 > r]
            index = torch.cat([torch.arange(starts[i] + parts[i][0][r], starts[i] + parts[i][0][r + 1])
                               for i in members]).to(mixed.device)
            rows = [meta.rows_cpu[i] for i in members]
            sub = LinearAttentionBatch.of_parts(
                rows, [meta.has_state_cpu[i] or r > 0 for i in members],
                [parts[i][0][r + 1] - parts[i][0][r] for i in members], mixed.device, triton=self.triton)
            out[index] = self._mix(mixed.index_select(0, index), a.index_select(0, index), b.index_select(0, index),
                                   conv_states, states, sub)
            cut = [(meta.rows_cpu[i], parts[i][1][r]) for i in members if r < len(parts[i][1])]
            if cut:
                rows_t = torch.tensor([row for row, _ in cut], dtype=torch.int64, device=mixed.device)
                slots_t = torch.tensor([slot for _, slot in cut], dtype=torch.int64, device=mixed.device)
                snap_conv.index_copy_(0, slots_t, conv_states.index_select(0, rows_t))
                snap_ssm.index_copy_(0, slots_t, states.index_select(0, rows_t))
        return out

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, t = self.heads, y.shape[0]
        return (y[:, :h.key_dim].view(t, h.num_k, h.k_head_dim),
                y[:, h.key_dim:2 * h.key_dim].view(t, h.num_k, h.k_head_dim),
                y[:, 2 * h.key_dim:].view(t, h.num_v, h.v_head_dim))

    # ------------------------------------------------------------------ Triton
    def _triton_forward(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                        states: torch.Tensor, meta: LinearAttentionBatch) -> torch.Tensor:
        kg = self._kernels
        weight = self.conv1d.weight
        if meta.decode:
            y = kg.causal_conv1d_decode(mixed, weight, conv_states, meta.state_rows, meta.has_state)
        else:
            y = kg.causal_conv1d_varlen(mixed, weight, conv_states, meta.state_rows, meta.has_state, meta.cu_seqlens,
                                        *meta.conv_tiles)
        q, k, v = self._split(y)
        if not meta.decode and max(meta.lens_cpu) >= CHUNKED_MIN_TOKENS and self._fla.available():
            g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
            initial = states.index_select(0, meta.state_rows) * meta.has_state[:, None, None, None]
            out, final = self._fla.chunk_gated_delta_rule(q, k, v, g, beta, initial, meta.cu_seqlens)
            states.index_copy_(0, meta.state_rows, final.to(states.dtype))
            return out
        return kg.fused_recurrent_gated_delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, states, meta.state_rows,
                                                   meta.has_state, meta.cu_seqlens)

    # ------------------------------------------------------------------ torch
    def _torch_decode(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                      states: torch.Tensor, meta: LinearAttentionBatch) -> torch.Tensor:
        """One token per row, batched, without a host sync."""
        rows, keep = meta.state_rows, meta.has_state
        window = conv_states[rows] * keep[:, None, None].to(conv_states.dtype)  # [B, K - 1, C]
        full = torch.cat((window, mixed[:, None, :].to(conv_states.dtype)), dim=1)  # [B, K, C]
        weight = self.conv1d.weight
        y = torch.nn.functional.silu((full.to(weight.dtype) * weight.t()[None]).sum(1)).to(mixed.dtype)
        conv_states[rows] = full[:, 1:]
        q, k, v = self._split(y)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        start = states[rows] * keep[:, None, None, None].to(states.dtype)
        out, new = recurrent_step(q, k, v, g, beta, start)
        states[rows] = new.to(states.dtype)
        return out

    def _torch_extend(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                      states: torch.Tensor, meta: LinearAttentionBatch) -> torch.Tensor:
        """Sequence by sequence: the conv and the chunked rule (the recurrent one for one token)."""
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        out = torch.empty(mixed.shape[0], self.heads.num_v, self.heads.v_head_dim, dtype=mixed.dtype,
                          device=mixed.device)
        start = 0
        for row, keep, n in zip(meta.rows_cpu, meta.has_state_cpu, meta.lens_cpu):
            part = slice(start, start + n)
            start += n
            y, window = causal_conv1d(mixed[part], self.conv1d.weight, conv_states[row] if keep else None)
            conv_states[row] = window
            q, k, v = self._split(y)
            rule = recurrent_gated_delta_rule if n == 1 else chunk_gated_delta_rule
            out[part], final = rule(q, k, v, g[part], beta[part], states[row] if keep else None)
            states[row] = final.to(states.dtype)
        return out
