"""The work list of one extend attention pass (radixserve.kernels.extend_attention), made on the host.

Pure Python and torch (no Triton import), so the CPU suite checks it. One plan serves every layer
of a forward pass; it reaches the device in one host-to-device copy.

Rows: request r's new tokens times the query heads of one KV head's group, flattened token-major
(row = token * group + head within the group), cut into tiles of block_m rows. Every tile is one
item per KV head, so a K/V tile a program loads feeds all the group's heads at once and the
tensor cores see block_m rows whatever the group (7 heads x 18.3 tokens for Qwen2-7B's 128).

Items: a tile attends over its request's prefix [0, prefix) from the pool, then causally over
the new tokens up to its last row's token. When the batch gives too few programs to fill the GPU
(a long prefix and few new tokens: one chunk of a long prompt), a tile's prefix is cut at
block_n boundaries into several items (splits). Only the last of them attends over the new
tokens; each writes its normalized partial output and base-2 log-sum-exp to a float32 workspace
and a merge kernel combines a tile's splits. Items are listed costliest first, so the last wave
of programs is short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

# The per-item and per-merge fields, in the order they are packed (each a row of int32).
ITEM_FIELDS = ("req", "m0", "lo", "hi", "part")
MERGE_FIELDS = ("req", "m0", "first_part", "num_parts")
# Counts are padded to this: Triton specialises integer arguments on divisibility by 16 and
# pointers on 16-byte alignment, so every batch shape shares one compiled variant.
PAD = 16


def _pad(n: int) -> int:
    return max(PAD, -(-n // PAD) * PAD)


@dataclass
class ExtendPlan:
    q_starts: torch.Tensor  # [B] int32: first row of each request's new tokens in q
    items: dict[str, torch.Tensor]  # ITEM_FIELDS -> [num_items] int32 views
    merges: dict[str, torch.Tensor]  # MERGE_FIELDS -> [num_merges] int32 views
    num_items: int
    num_merges: int
    num_parts: int  # partial outputs the split items write
    group: int
    block_m: int
    block_n: int
    # What the host decided, for tests and benchmarks: [(req, m0, lo, hi, part)].
    host_items: list[tuple[int, int, int, int, int]] = field(default_factory=list, repr=False)
    _workspace: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    def workspace(self, num_kv_heads: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(mid_o [parts, Hkv, block_m, D], mid_lse [parts, Hkv, block_m]) float32, made by the first
        layer and reused by the others (they run one after another on one stream)."""
        shape = (max(1, self.num_parts), num_kv_heads, self.block_m)
        ws = self._workspace
        if ws is None or ws[1].shape != shape or ws[0].shape[-1] != head_dim or ws[0].device != torch.device(device):
            ws = (torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
                  torch.empty(shape, dtype=torch.float32, device=device))
            self._workspace = ws
        return ws


def tile_rows(extend: int, group: int, block_m: int) -> list[tuple[int, int]]:
    """(first row, last row's token + 1) of each tile of one request."""
    rows = extend * group
    return [(m0, min((m0 + block_m - 1) // group, extend - 1) + 1) for m0 in range(0, rows, block_m)]


def split_bounds(prefix: int, causal: int, num_splits: int, block_n: int) -> list[int]:
    """Prefix positions where the splits of one tile start after the first: multiples of block_n,
    increasing and strictly below prefix, so every split but the last covers whole tiles and the
    last ([last bound, prefix) plus the causal part) is the only one that reaches the prefix's end
    (the kernel attends over the new tokens in the item whose range ends there)."""
    total = prefix + causal
    limit = ((prefix - 1) // block_n) * block_n
    bounds: list[int] = []
    for i in range(1, num_splits):
        b = min(limit, round(i * total / num_splits / block_n) * block_n)
        if b > (bounds[-1] if bounds else 0):
            bounds.append(b)
    return bounds


def choose_split_len(works: list[int], num_kv_heads: int, num_sms: int, split_programs_per_sm: int,
                     min_split_len: int, block_n: int) -> Optional[int]:
    """KV positions per split, or None (no split): a tile is split when the batch's items are fewer
    than split_programs_per_sm per SM, into pieces of about the same work so that the programs
    come to that many per SM."""
    target = split_programs_per_sm * num_sms
    if not split_programs_per_sm or not works or len(works) * num_kv_heads >= target:
        return None
    per_program = math.ceil(sum(works) * num_kv_heads / target)
    return max(min_split_len, -(-per_program // block_n) * block_n)


def plan_extend(extend_lens: list[int], prefix_lens: list[int], *, group: int, block_m: int, block_n: int,
                device: torch.device | str, num_kv_heads: int = 1, num_sms: int = 132,
                split_programs_per_sm: int = 0, min_split_len: int = 512, first_request: int = 0) -> ExtendPlan:
    """The items of one pass; requests before `first_request` get none (another kernel attends
    for them: the decoding requests of a mixed step). num_kv_heads and num_sms only steer the split."""
    q_starts: list[int] = []
    tiles: list[tuple[int, int, int, int, int]] = []  # (work, req, m0, prefix, causal)
    offset = 0
    for r, (ext, prefix) in enumerate(zip(extend_lens, prefix_lens)):
        q_starts.append(offset)
        offset += ext
        if r < first_request:
            continue
        for m0, causal in tile_rows(ext, group, block_m):
            tiles.append((prefix + causal, r, m0, prefix, causal))
    split_len = choose_split_len([t[0] for t in tiles], num_kv_heads, num_sms, split_programs_per_sm,
                                 min_split_len, block_n)
    items: list[tuple[int, int, int, int, int, int]] = []  # (-work, req, m0, lo, hi, part)
    merges: list[tuple[int, int, int, int]] = []
    num_parts = 0
    for work, r, m0, prefix, causal in tiles:
        bounds = split_bounds(prefix, causal, -(-work // split_len), block_n) if split_len else []
        if not bounds:
            items.append((-work, r, m0, 0, prefix, -1))
            continue
        starts = [0] + bounds
        ends = bounds + [prefix]
        merges.append((r, m0, num_parts, len(starts)))
        for lo, hi in zip(starts, ends):
            items.append((-(hi - lo + (causal if hi == prefix else 0)), r, m0, lo, hi, num_parts))
            num_parts += 1
    items.sort()
    packed = _pack([q_starts] + [[it[i + 1] for it in items] for i in range(len(ITEM_FIELDS))]
                   + [[mg[i] for mg in merges] for i in range(len(MERGE_FIELDS))], device)
    q_dev, rest = packed[0], packed[1:]
    return ExtendPlan(
        q_starts=q_dev, items=dict(zip(ITEM_FIELDS, rest[:len(ITEM_FIELDS)])),
        merges=dict(zip(MERGE_FIELDS, rest[len(ITEM_FIELDS):])), num_items=len(items), num_merges=len(merges),
        num_parts=num_parts, group=group, block_m=block_m, block_n=block_n,
        host_items=[it[1:] for it in items])


def _pack(columns: list[list[int]], device: torch.device | str) -> list[torch.Tensor]:
    """One int32 host-to-device copy; each column a view starting on a 16-element boundary."""
    flat: list[int] = []
    spans = []
    for col in columns:
        spans.append((len(flat), len(col)))
        flat.extend(col)
        flat.extend([0] * (_pad(len(col)) - len(col)))
    host = torch.tensor(flat, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return [dev[start:start + n] for start, n in spans]
