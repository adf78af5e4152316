"""The Triton kernels on the CPU through Triton's interpreter: a quick subset of tests/gpu.

The interpreter must be on (TRITON_INTERPRET=1) before a kernel is defined, so the subset runs in
a child pytest with that variable set. With CUDA, tests/gpu runs all of them natively instead.
Everything in tests/gpu that the interpreter can run: `TRITON_INTERPRET=1 python -m pytest
tests/gpu` (tens of minutes on two cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FILES = ["tests/gpu/test_triton_fused.py", "tests/gpu/test_decode_linear.py", "tests/gpu/test_triton_attention.py",
         "tests/gpu/test_triton_layers.py", "tests/gpu/test_token_bitmask.py", "tests/gpu/test_fp8_kernels.py",
         "tests/gpu/test_fused_moe.py", "tests/gpu/test_gated_delta_kernels.py",
         "tests/gpu/test_extend_attention_gpu.py"]
# Left out here, a minute or more each under the interpreter: the extend kernel's tile-shape test,
# the decode-row GEMM at the Qwen2 projection shapes (each kernel path is still covered at
# its small shapes: 200 x 256 plain, 100 x 128 with SiLU-and-mul), and three of the four hybrid
# model cases (Qwen3-Next's stays: every Gated DeltaNet kernel runs in it; the fused MoE has its own).
SELECTION = ("not tile_shapes and (not test_matches_reference or 200-256) "
             "and (not test_silu_mul_matches_unfused or 100-128) "
             "and not qwen3_5-decode-gemm-rows and not qwen3_5-long-prompt and not qwen3_5_moe-cublas-rows")
# What the interpreter cannot run: CUDA graph replays (3), the direct C launcher (1), fla's chunked
# Gated DeltaNet (1, CUDA only), bfloat16 recurrent states (1), and the fused
# RoPE + FP8 KV store and the FP8 activation quantization of random values compared with torch's
# (21: the interpreter rounds float32 -> e4m3 wrongly where it carries into the exponent, see
# tests/gpu/test_fp8_kernels.py).
EXPECTED_SKIPS = 27


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu runs these natively")
def test_triton_kernels_under_the_interpreter(tmp_path):
    report = tmp_path / "report.xml"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           f"--junitxml={report}", "-k", SELECTION, *FILES],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, output
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    assert int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0, output
    # A module skipped whole (triton missing, the interpreter off) would pass with nothing run.
    assert skipped == EXPECTED_SKIPS and tests - skipped >= 80, output
