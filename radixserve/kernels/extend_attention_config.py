"""Which tiles and launch shape the extend attention kernel (radixserve.kernels.extend_attention)
runs with, per head dimension.

Pure Python (no Triton import), so the CPU suite checks the choices. `TUNED` is filled from
`scripts/extend_attention_sweep.py --print-table` on an H200; a head dimension it lacks gets
`default_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

SHARED_MEMORY_BUDGET = 220 << 10  # bytes of q + pipelined K/V tiles per program (an H200 SM has 227 KB)


@dataclass(frozen=True)
class ExtendAttentionConfig:
    """block_m: rows of a program, each row one (new token, query head) of one KV head's group, token
    major (GQA packing: each K/V tile is loaded once for the whole group); block_n: KV positions
    per tile; num_warps / num_stages: the launch; split_programs_per_sm: when the batch gives fewer
    programs than this many per SM, long prefixes are split over several programs whose partial
    results a second kernel merges (0: never split); min_split_len: the fewest prefix positions a
    split covers; prefetch_slots: load the next tile's req_to_token slots one iteration ahead by
    hand (on top of what Triton's pipeliner does for the indirect loads); tma_new: read the new
    tokens' contiguous K/V (phase 2) through tensor descriptors (TMA) instead of pointer loads;
    warp_specialize: ask Triton to warp-specialise the phase-2 loop (with tma_new)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    split_programs_per_sm: int = 4
    min_split_len: int = 512
    prefetch_slots: bool = False
    tma_new: bool = False
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} {v} must be a power of two >= 16")
        if self.min_split_len % self.block_n:
            raise ValueError(f"min_split_len {self.min_split_len} must be a multiple of block_n {self.block_n}")
        if self.warp_specialize and not self.tma_new:
            raise ValueError("warp_specialize needs tma_new")

    def label(self) -> str:
        flags = "".join(f" {n}" for n in ("prefetch_slots", "tma_new", "warp_specialize") if getattr(self, n))
        return (f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages} "
                f"split{self.split_programs_per_sm}/{self.min_split_len}{flags}")


# Per head dimension, for bf16/fp16 queries (the pool bf16 or FP8), from the sweep on an H200
# (docs/runs/2026-12-03-extend-attention.md): per head dim the config with the smallest worst-case
# slowdown against each shape's best. Splitting long prefixes never won at these shapes (the merge
# costs more than the idle SMs), so it is off. Head dim 64 was not swept (the per-head kernel's tiles).
TUNED: dict[int, ExtendAttentionConfig] = {
    64: ExtendAttentionConfig(128, 64, 4, 3),
    # 1x(7168+1024) 0.288 ms 2.04x its floor | 16x(1024+128) 0.111 ms 2.77x | 1x(0+8192) 0.989 ms 1.64x
    128: ExtendAttentionConfig(256, 64, 16, 3, split_programs_per_sm=0, prefetch_slots=True),
    # Qwen3.5-27B's gated attention, 16x(1024+128) 0.181 ms 2.64x
    256: ExtendAttentionConfig(128, 64, 8, 2, split_programs_per_sm=0),
}


def shared_memory_bytes(config: ExtendAttentionConfig, head_dim: int, element_size: int) -> int:
    """q's tile plus num_stages K and V tiles (what the pipeline keeps in shared memory)."""
    return (config.block_m + 2 * config.num_stages * config.block_n) * head_dim * element_size


def default_config(head_dim: int) -> ExtendAttentionConfig:
    """The tuned entry of the nearest head dimension not below this one (the widest otherwise)."""
    for d in sorted(TUNED):
        if d >= head_dim:
            return TUNED[d]
    return TUNED[max(TUNED)]


def config_for(head_dim: int, dtype: torch.dtype) -> ExtendAttentionConfig:
    """The kernel's config for queries of `dtype` (the dots' operand type) and `head_dim`. float32
    tiles (tests, fp32 models) take twice the bytes: both sides halved, two stages; then stages are
    cut until the tiles fit shared memory."""
    config = TUNED.get(head_dim) or default_config(head_dim)
    if dtype == torch.float32:
        bn = max(16, config.block_n // 2)
        config = replace(config, block_m=max(16, config.block_m // 2), block_n=bn, num_stages=2,
                         min_split_len=max(bn, config.min_split_len), tma_new=False, warp_specialize=False)
    return fit_shared_memory(config, head_dim, torch.empty((), dtype=dtype).element_size())


def fit_shared_memory(config: ExtendAttentionConfig, head_dim: int, element_size: int) -> ExtendAttentionConfig:
    """Fewer stages (down to 2) while the pipeline's tiles overflow SHARED_MEMORY_BUDGET."""
    stages = config.num_stages
    while stages > 2 and shared_memory_bytes(replace(config, num_stages=stages), head_dim,
                                             element_size) > SHARED_MEMORY_BUDGET:
        stages -= 1
    return config if stages == config.num_stages else replace(config, num_stages=stages)
