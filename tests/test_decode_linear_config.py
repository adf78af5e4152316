"""Which decode-row GEMM variant runs for a weight (radixserve.kernels.decode_linear_config; CPU).

The kernel itself is checked against a reference on the GPU (tests/gpu/test_decode_linear.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from radixserve.kernels.decode_linear_config import (DEFAULT_FP8_MODE, SHARED_MEMORY_BUDGET, TUNED, TUNED_FP8,
                                                     DecodeLinearConfig, block_m_for, config_for, default_config,
                                                     pipeline_stages, split_plan)
from radixserve.model.config import ModelConfig
from radixserve.model.layers import KernelChoice, Linear, MergedLinear, SiluAndMul
from radixserve.model.layers.linear import FP8_DECODE_ROWS_FACTOR
from radixserve.model.quantization import Fp8Config
from radixserve.settings import DECODE_GEMM_MAX_ROWS, ServerSettings

QWEN2_CONFIGS = ["benchmarks/configs/qwen2-7b", "benchmarks/configs/qwen2-0.5b"]


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    h = cfg.hidden_size
    return [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * cfg.intermediate_size, h),
            (h, cfg.intermediate_size), (cfg.vocab_size, h)]


@pytest.mark.parametrize("path", QWEN2_CONFIGS)
def test_every_qwen2_projection_has_its_tuned_variant(path):
    cfg = ModelConfig.from_dir(path)
    for n, k in projection_shapes(cfg):
        weight = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
        assert config_for(weight) is TUNED[(n, k)]


@pytest.mark.parametrize("shape,config", list(TUNED.items()))
def test_tuned_variants_tile_their_shape_and_fit_up_to_the_row_limit(shape, config):
    n, k = shape
    assert k % config.block_k == 0
    per_split, splits = split_plan(k, config)
    k_tiles = k // config.block_k
    assert splits == config.split and per_split * (splits - 1) < k_tiles <= per_split * splits  # none empty
    # Up to DECODE_GEMM_MAX_ROWS rows the tuned pipeline depth is what runs (it was measured so).
    assert pipeline_stages(config, block_m_for(DECODE_GEMM_MAX_ROWS), 2) == config.num_stages


def test_block_m_pads_to_a_tensor_core_tile():
    assert [block_m_for(m) for m in (1, 15, 16, 17, 32, 33, 64, 500)] == [16, 16, 16, 32, 32, 64, 64, 64]


def test_pipeline_shrinks_instead_of_overflowing_shared_memory():
    deep = DecodeLinearConfig(block_n=128, block_k=128, num_stages=5)
    assert pipeline_stages(deep, 16, 2) == 5
    stages = pipeline_stages(deep, 64, 2)  # 5 x (128 + 64) x 128 x 2 B = 240 KB
    assert 2 <= stages < 5 and stages * (128 + 64) * 128 * 2 <= SHARED_MEMORY_BUDGET


def test_pipeline_counts_one_byte_weights():
    wide = DecodeLinearConfig(block_n=64, block_k=512, num_stages=5)
    bf16 = pipeline_stages(wide, 64, 2)  # (64 + 64) x 512 x 2 B = 128 KB a stage
    fp8 = pipeline_stages(wide, 64, 2, 1)  # (64 x 1 + 64 x 2) x 512 = 96 KB a stage
    assert bf16 == 2 and fp8 == 2
    assert pipeline_stages(DecodeLinearConfig(64, 256, num_stages=5), 16, 2, 1) == 5  # 5 x 24 KB
    assert pipeline_stages(DecodeLinearConfig(64, 256, num_stages=5), 16, 2) == 5  # 5 x 40 KB
    assert pipeline_stages(DecodeLinearConfig(128, 256, num_stages=5), 64, 2, 1) == 3  # 64 KB a stage


@pytest.mark.parametrize("path", QWEN2_CONFIGS)
def test_fp8_weights_take_their_own_variant_else_the_bf16_one(path, monkeypatch):
    cfg = ModelConfig.from_dir(path)
    n, k = cfg.hidden_size, cfg.q_size  # o_proj
    fp8 = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    bf16 = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
    assert config_for(fp8) == (TUNED_FP8.get((n, k)) or replace(config_for(bf16), fp8_mode=DEFAULT_FP8_MODE))
    own = DecodeLinearConfig(64, 128, 2, 4, 3, "tile_fp8")
    monkeypatch.setitem(TUNED_FP8, (n, k), own)
    assert config_for(fp8) is own and config_for(bf16) is not own


@pytest.mark.parametrize("shape,config", list(TUNED_FP8.items()))
def test_tuned_fp8_variants_tile_their_shape(shape, config):
    n, k = shape
    assert k % config.block_k == 0 and split_plan(k, config)[1] == config.split


def test_fp8_mode_is_checked():
    with pytest.raises(ValueError, match="fp8_mode"):
        DecodeLinearConfig(fp8_mode="int8")


def test_default_config():
    assert default_config(1000, 100) is None  # K not a whole number of 64-wide tiles
    assert default_config(512, 192).block_k == 64
    narrow_long = default_config(512, 16384)  # 8 strips of 64 rows: K is split to feed the GPU
    assert narrow_long.split > 1
    _, splits = split_plan(16384, narrow_long)
    assert 8 * splits <= 256 and 16384 // 128 // splits >= 16
    wide = default_config(65536, 4096)  # 1,024 strips already: no split, a shallow pipeline (big matrix)
    assert wide.split == 1 and wide.num_stages == 3


def test_config_for_rejects_what_the_kernel_cannot_read():
    assert config_for(torch.empty(4608, 3584, dtype=torch.bfloat16, device="meta").t()) is None  # columns strided
    assert config_for(torch.empty(64, 100, device="meta")) is None
    assert config_for(torch.empty(8, 64, 64, device="meta")) is None


def test_the_row_limit_is_a_server_setting_with_the_models_default():
    assert ServerSettings().decode_gemm_max_rows == DECODE_GEMM_MAX_ROWS == KernelChoice().decode_gemm_max_rows
    assert ServerSettings.from_kwargs(decode_gemm_max_rows=0).decode_gemm_max_rows == 0
    with pytest.raises(ValueError, match="decode_gemm_max_rows"):
        ServerSettings.from_kwargs(decode_gemm_max_rows=-1)


def test_kernels_are_chosen_for_the_device_once():
    assert KernelChoice.for_device("cpu", torch.bfloat16) == KernelChoice(triton=False)
    assert KernelChoice.for_device("cpu", torch.float32, decode_gemm_max_rows=0).decode_gemm_max_rows == 0
    with pytest.raises(ValueError, match="CUDA"):
        KernelChoice.for_device("cpu", torch.bfloat16, triton=True)
    with pytest.raises(ValueError, match="decode_gemm_max_rows"):
        KernelChoice(decode_gemm_max_rows=-1)


def test_a_projection_takes_the_decode_gemm_only_with_the_triton_kernels():
    """The layer decides at construction (on the meta device: nothing is launched here)."""
    triton = KernelChoice(triton=True)
    with torch.device("meta"):
        def qkv(kernels):
            return MergedLinear(3584, {"q": 3584, "k": 512, "v": 512}, bias=True, dtype=torch.bfloat16, kernels=kernels)

        assert qkv(triton).quant_method.decode_config is TUNED[(4608, 3584)]
        assert qkv(triton).quant_method.decode_max_rows == DECODE_GEMM_MAX_ROWS
        assert qkv(KernelChoice(triton=True, decode_gemm_max_rows=0)).quant_method.decode_config is None
        assert qkv(KernelChoice(triton=False)).quant_method.decode_config is None
        gate_up = MergedLinear(3584, {0: 18944, 1: 18944}, bias=False, dtype=torch.bfloat16, kernels=triton,
                               act=SiluAndMul(kernels=triton))
        assert gate_up.quant_method.decode_config is TUNED[(37888, 3584)]  # SiLU-and-mul fused into its epilogue
        untileable = Linear(100, 64, bias=False, dtype=torch.bfloat16, kernels=triton)  # K: no whole tiles
        assert untileable.quant_method.decode_config is None
        fp8 = MergedLinear(3584, {"q": 3584, "k": 512, "v": 512}, bias=True, dtype=torch.bfloat16, kernels=triton,
                           fp8=Fp8Config(from_checkpoint=False))
        config = fp8.quant_method.decode_config
        assert config is TUNED_FP8[(4608, 3584)] and config.fp8_mode == "token_fp8"
        assert fp8.quant_method.decode_max_rows == FP8_DECODE_ROWS_FACTOR * DECODE_GEMM_MAX_ROWS
