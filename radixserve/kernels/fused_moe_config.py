"""Which tiles the fused MoE's grouped GEMMs (radixserve.kernels.fused_moe) run for a shape.

Pure Python (no Triton import), so the CPU suite checks the choices; the kernels are in
fused_moe.py.

A grouped GEMM multiplies, for every expert, the rows routed to it (padded to BLOCK_M) by that
expert's weight [N, K]. Its best tile depends on how many rows each expert gets, so a config is
picked per (experts, N, K) and per number of tokens in the step: a decode step of a few tokens
spread over 128 experts gives each expert one or two rows (a 16-row tile, weights streamed once:
the step reads only the experts it touches), a prefill chunk gives each hundreds (a 64- or
128-row tile that reuses each weight tile across its rows). The number of tokens of a CUDA graph
is fixed, so each graph keeps the config it was captured with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SHARED_MEMORY_BUDGET = 200 << 10  # bytes of pipeline buffers per program (an H100/H200 SM has 227 KB)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FusedMoeConfig:
    """Rows of the routed tokens per tile (BLOCK_M: also the padding of each expert's rows), output
    columns per tile (BLOCK_N: half gate, half up for the gate|up GEMM with SiLU), the K tile,
    how many M tiles share one N tile before the next (GROUP_M: weight tiles stay in L2), and the
    launch's warps and pipeline stages."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value}: a power of two, at least 16 (the smallest tensor-core tile)")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"group_m={self.group_m}, num_warps={self.num_warps}, num_stages={self.num_stages}: "
                             "group_m >= 1, num_warps a power of two up to 16, num_stages >= 1")


# Per (experts, N, K) of a weight (gate|up: N = 2 x moe_intermediate_size of this rank, K = hidden;
# down: N = hidden, K = the rank's intermediate), buckets of (most tokens in the step, config),
# ascending; more tokens than the last bucket take the last. From scripts/fused_moe_sweep.py on an
# H200 (random routing, L2 flushed). Comments: us of the gate|up + down pair at that many tokens,
# the default config's in brackets. A shape not listed takes `default_config`.
_C = FusedMoeConfig
TUNED: dict[tuple[int, int, int], tuple[tuple[int, FusedMoeConfig], ...]] = {
    # Qwen3-30B-A3B (128 experts, top-8, hidden 2048, moe_intermediate 768) at tp 1.
    (128, 1536, 2048): (
        (1, _C(16, 128, 128, 1, 4, 4)),    # 36.6 (37.7)
        (16, _C(16, 64, 128, 1, 4, 3)),    # 201.0 (202.0)
        (64, _C(16, 64, 128, 8, 4, 5)),    # 294.3 (296.1)
        (256, _C(32, 128, 128, 8, 4, 3)),  # 308.2 (310.7)
        (1024, _C(64, 128, 64, 8, 4, 3)),  # 365.4 (395.8)
        (4096, _C(128, 128, 64, 1, 8, 3)),  # 723.0 (868.0)
    ),
    (128, 2048, 768): (
        (1, _C(16, 64, 128, 1, 4, 3)),
        (16, _C(16, 64, 128, 1, 4, 3)),
        (64, _C(16, 128, 128, 8, 4, 3)),
        (256, _C(32, 64, 128, 8, 4, 4)),
        (1024, _C(64, 128, 64, 1, 8, 3)),
        (4096, _C(128, 128, 64, 1, 8, 3)),
    ),
    # Qwen2-57B-A14B (64 experts, top-8, hidden 3584, moe_intermediate 2560) at tp 1.
    (64, 5120, 3584): (
        (1, _C(16, 64, 128, 1, 4, 3)),     # 127.8 (138.1)
        (16, _C(16, 64, 128, 1, 4, 5)),    # 675.6 (677.5)
        (64, _C(16, 64, 128, 1, 4, 5)),    # 802.8 (805.0)
        (256, _C(64, 128, 128, 1, 4, 4)),  # 845.2 (1010.3)
        (1024, _C(128, 128, 64, 1, 4, 3)),  # 1369.6 (1453.4)
        (4096, _C(128, 128, 64, 8, 8, 3)),  # 4231.6 (4830.8)
    ),
    (64, 3584, 2560): (
        (1, _C(16, 128, 128, 1, 4, 3)),
        (16, _C(16, 64, 128, 1, 4, 3)),
        (64, _C(16, 128, 128, 1, 4, 4)),
        (256, _C(64, 64, 64, 1, 4, 3)),
        (1024, _C(128, 128, 64, 8, 8, 3)),
        (4096, _C(128, 128, 64, 8, 8, 3)),
    ),
}


def default_config(num_experts: int, n: int, k: int, tokens: int, top_k: int,
                   weight_bytes: int = 2) -> FusedMoeConfig:
    """Tiles from the rows an expert gets on average (tokens x top_k / experts): a handful (decode)
    take 16-row tiles with long K tiles, streaming each touched expert's weights once; dozens take
    32- or 64-row tiles; hundreds (prefill) 64 x 128 tiles grouped for L2 reuse. One-byte (FP8)
    weights take K tiles of 128 so a block-wise scale covers a whole tile."""
    rows = tokens * top_k / max(1, num_experts)
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    if rows <= 8:
        config = FusedMoeConfig(16, 64, block_k, 1, 4, 4)
    elif rows <= 32:
        config = FusedMoeConfig(32, 64, block_k, 4, 4, 4)
    elif rows <= 96:
        config = FusedMoeConfig(64, 64, min(block_k, 64), 8, 4, 4)
    else:
        config = FusedMoeConfig(64, 128, 128 if weight_bytes == 1 and block_k == 128 else 64, 8, 4, 3)
    if n < config.block_n:  # a narrow weight (tiny models, a high tp): one tile covers it
        config = FusedMoeConfig(config.block_m, max(16, 1 << (n - 1).bit_length()), config.block_k,
                                config.group_m, config.num_warps, config.num_stages)
    return config


def config_for(num_experts: int, n: int, k: int, tokens: int, top_k: int,
               weight_bytes: int = 2) -> FusedMoeConfig:
    """The config for an [experts, N, K] weight in a step of `tokens` tokens."""
    buckets = TUNED.get((num_experts, n, k))
    if buckets:
        for most, config in buckets:
            if tokens <= most:
                return config
        return buckets[-1][1]
    return default_config(num_experts, n, k, tokens, top_k, weight_bytes)


def max_padded_rows(slots: int, num_experts: int, block_m: int) -> int:
    """The most rows the sorted, padded routing can take for `slots` = tokens x top_k (token,
    expert) pairs: each expert's rows are padded up to a multiple of block_m, and at most
    min(experts, slots) experts get any. Static for a given batch (CUDA graphs), whatever the
    routing turns out to be."""
    return slots + min(num_experts, slots) * (block_m - 1)


def pipeline_stages(config: FusedMoeConfig, a_bytes: int, w_bytes: int) -> int:
    """config.num_stages, fewer if a stage's A and weight tiles would overflow shared memory."""
    stage = (config.block_m * a_bytes + config.block_n * w_bytes) * config.block_k
    stages = config.num_stages
    while stages > 2 and stages * stage > SHARED_MEMORY_BUDGET:
        stages -= 1
    return stages


def block_k_fits_scale_blocks(config: FusedMoeConfig, scale_block_k: Optional[int]) -> bool:
    """Whether every K tile lies inside one block of a block-wise scale (so one scale per tile row)."""
    return scale_block_k is None or (scale_block_k % config.block_k == 0)
