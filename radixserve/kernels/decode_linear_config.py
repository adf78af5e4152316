"""Which variant of the decode-row GEMM (radixserve.kernels.decode_linear) runs for a weight.

Pure Python (no Triton import), so the CPU suite checks the choices; the kernel itself is in
decode_linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

SHARED_MEMORY_BUDGET = 200 << 10  # bytes of pipeline buffers per program (an SM has 227 KB)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# How the FP8 kernel (radixserve.kernels.decode_linear_fp8) multiplies e4m3 weights by bf16 rows:
# "token_fp8" (activations quantized to e4m3 per token in front, by one kernel or by the RMSNorm
# before the projection, as the prefill path's cuBLASLt GEMM takes them: FP8 tensor cores on both
# operands; the default, fastest on an H200), "widen" (weights widened to bf16 in registers,
# activations exact), "fp16" (weights widened to fp16, activations rounded to fp16), "tile_fp8"
# (activations quantized to e4m3 per token and K tile inside the kernel), "tile_fp8x2" (the same
# plus a second e4m3 term for the first one's error: nearly bf16 activations). The bf16 kernel
# ignores it.
FP8_MODES = ("token_fp8", "widen", "fp16", "tile_fp8", "tile_fp8x2")
DEFAULT_FP8_MODE = "token_fp8"


@dataclass(frozen=True)
class DecodeLinearConfig:
    """Rows of W per program (output columns; half gate, half up with silu_mul), the K tile, the
    number of K splits, the launch's warps and pipeline stages, and for e4m3 weights how they are
    multiplied (FP8_MODES)."""

    block_n: int = 64
    block_k: int = 128
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fp8_mode: str = "widen"

    def __post_init__(self) -> None:
        if self.fp8_mode not in FP8_MODES:
            raise ValueError(f"fp8_mode {self.fp8_mode!r}: expected one of {FP8_MODES}")


# Per (N, K), for the projections of Qwen2-7B and Qwen2-0.5B: the variant fastest over 1-32 rows
# in scripts/decode_linear_sweep.py on an H200 (docs/runs/2026-12-01-decode-row-gemm.md).
# Comments: us per call at 16 / 32 rows, cuBLAS's in brackets; gate_up with the fused SiLU
# (cuBLAS + silu_and_mul in brackets). Other shapes get `default_config`.
TUNED: dict[tuple[int, int], DecodeLinearConfig] = {
    (4608, 3584): DecodeLinearConfig(64, 128, 1, 4, 5),     # 7B qkv: 11.5 / 11.6 (11.6 / 11.5)
    (3584, 3584): DecodeLinearConfig(64, 128, 1, 4, 5),     # 7B o: 10.2 / 10.9 (11.0 / 11.4)
    (37888, 3584): DecodeLinearConfig(64, 128, 1, 4, 3),    # 7B gate_up+SiLU: 68.0 / 70.0 (75.3 / 77.9)
    (3584, 18944): DecodeLinearConfig(64, 128, 2, 4, 5),    # 7B down: 38.3 / 39.8 (39.4 / 41.2)
    (152064, 3584): DecodeLinearConfig(128, 128, 1, 4, 3),  # 7B lm_head: 247.5 / 262.6 (274.5 / 271.2)
    (1152, 896): DecodeLinearConfig(64, 128, 1, 4, 5),      # 0.5B qkv: 4.2 / 4.4 (4.6 / 4.5)
    (896, 896): DecodeLinearConfig(64, 128, 1, 4, 5),       # 0.5B o: 4.0 / 4.3 (4.4 / 4.3)
    (9728, 896): DecodeLinearConfig(128, 128, 1, 4, 5),     # 0.5B gate_up+SiLU: 7.3 / 7.7 (9.1 / 9.4)
    (896, 4864): DecodeLinearConfig(64, 128, 8, 4, 5),      # 0.5B down: 7.4 / 7.7 (7.5 / 7.5)
    (151936, 896): DecodeLinearConfig(64, 128, 1, 4, 3),    # 0.5B lm_head: 70.0 / 71.2 (71.8 / 74.0)
}


# Per (N, K), the variants for e4m3 weights (radixserve.kernels.decode_linear_fp8), where they differ
# from the bf16 choice, from `scripts/decode_linear_sweep.py --fp8` on an H200
# (docs/runs/2026-12-02-fp8-activations-agent-vs-fcfs.md). Comments: us per call at 64 rows,
# activation quantization included, against the bf16 kernel / cuBLAS and cuBLASLt's FP8 GEMM
# (`torch._scaled_mm`, quantization included).
# A shape not listed takes the bf16 variant in DEFAULT_FP8_MODE.
TUNED_FP8: dict[tuple[int, int], DecodeLinearConfig] = {
    (4608, 3584): DecodeLinearConfig(64, 128, 1, 4, 5, "token_fp8"),   # 7B qkv: 13.5 (14.2 / 11.2; 19.9)
    (3584, 3584): DecodeLinearConfig(64, 128, 2, 4, 5, "token_fp8"),   # 7B o: 12.8 (13.8 / 9.7; 16.7)
    (37888, 3584): DecodeLinearConfig(64, 128, 1, 4, 5, "token_fp8"),  # 7B gate_up+SiLU: 49.3 (79.5; 62.5)
    (3584, 18944): DecodeLinearConfig(64, 128, 4, 4, 5, "token_fp8"),  # 7B down: 34.3 (40.6 / 41.7; 57.5)
}


def default_config(n: int, k: int) -> Optional[DecodeLinearConfig]:
    """64-row strips; K split until there are ~128 programs, each streaming >= 16 K tiles; deeper
    pipelines for small matrices (their programs are few and short). None if K is not a whole
    number of 64-wide tiles."""
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 0
    if not block_k:
        return None
    split = max(1, min(k // block_k // 16, _cdiv(128, _cdiv(n, 64))))
    return DecodeLinearConfig(64, block_k, split, 4, 3 if n * k >= (32 << 20) else 5)


def config_for(weight: torch.Tensor) -> Optional[DecodeLinearConfig]:
    """The variant for this weight (e4m3 weights: `TUNED_FP8` first), or None when decode_linear
    cannot take it."""
    if weight.dim() != 2:
        return None
    n, k = weight.shape
    config = TUNED.get((n, k)) or default_config(n, k)
    if weight.dtype == torch.float8_e4m3fn:
        config = TUNED_FP8.get((n, k)) or (config and replace(config, fp8_mode=DEFAULT_FP8_MODE))
    return config if config is not None and supported(weight, config) else None


def block_m_for(m: int) -> int:
    """Rows of x per program: the batch padded to a power of two, at least 16 (the smallest
    tensor-core tile), at most 64 (more rows are more programs along M)."""
    return min(64, max(16, 1 << (m - 1).bit_length()))


def split_plan(k: int, config: DecodeLinearConfig) -> tuple[int, int]:
    """(K tiles per split, splits): every split a whole number of tiles, none empty."""
    k_tiles = k // config.block_k
    per_split = _cdiv(k_tiles, config.split)
    return per_split, _cdiv(k_tiles, per_split)


def pipeline_stages(config: DecodeLinearConfig, block_m: int, element_size: int,
                    weight_element_size: Optional[int] = None) -> int:
    """config.num_stages, fewer if a stage's weight and x tiles would overflow shared memory
    (an H100/H200 SM has 227 KB): a row count above the tuned ones must not fail to compile.
    element_size: bytes of an x element; weight_element_size: of a weight element (default the same)."""
    w_size = element_size if weight_element_size is None else weight_element_size
    stage_bytes = (config.block_n * w_size + block_m * element_size) * config.block_k
    stages = config.num_stages
    while stages > 2 and stages * stage_bytes > SHARED_MEMORY_BUDGET:
        stages -= 1
    return stages


def supported(weight: torch.Tensor, config: DecodeLinearConfig) -> bool:
    """Whether `decode_linear` takes this weight: K a whole number of BLOCK_K tiles, contiguous rows."""
    return weight.dim() == 2 and weight.stride(1) == 1 and weight.stride(0) == weight.shape[1] \
        and weight.shape[1] % config.block_k == 0
