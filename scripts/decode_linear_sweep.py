"""Sweep of `radixserve.kernels.decode_linear` against cuBLAS at decode batch sizes, on a GPU.

    python scripts/decode_linear_sweep.py --models benchmarks/configs/qwen2-7b benchmarks/configs/qwen2-0.5b \
        --rows 1 16 64 --json linear.json

Every projection of each model (qkv, o, gate_up, down, lm_head) at M rows, timed the way a
captured decode step runs it (many calls, each on its own copy of the weights, in one CUDA
graph; see decode_sweep.py): cuBLAS (torch.matmul / addmm), then the Triton kernel over tiles
(BLOCK_N x BLOCK_K), pipeline stages, warps and K splits (the split reduce included), plain
pointer loads and, where this Triton has them, TMA tensor-descriptor loads. With --silu-mul,
gate_up runs with the fused activation (against cuBLAS + our silu_and_mul). Prints, per shape,
the floor (weights + activations once at the measured copy bandwidth), cuBLAS and the best
three variants.

FP8 weights (e4m3, one scale per output row, as `--quantization fp8` loads them):

    python scripts/decode_linear_sweep.py --models benchmarks/configs/qwen2-7b --fp8-prefill --fp8 \
        --rows 64 16 1 256 --json fp8_linear.json

--fp8: qkv, o, gate_up (with the fused SiLU) and down at each M, timed the same way: the bf16
kernel with its tuned variant and cuBLAS; the FP8 decode-row GEMM with the variant the model runs
today; torch._scaled_mm with row-wise scales (the model's path above the decode-row limit: the
activations quantized per token, by one kernel and by torch ops; alone on pre-quantized
activations, with fast accumulation, with the bias in the GEMM); then the FP8 kernel over
FP8_MODE_GRID with activations quantized per token in front ("token_fp8", the model's default;
also timed on activations already quantized: what folding the quantization into the op before
would save), FP8_GRID widened to bf16, and FP8_MODE_GRID again with the activations quantized
per K tile in the kernel (one e4m3 term or two) and with the fp16 dot, within --grid-budget-s
(rows in the order given: the first M of each shape gets the compiles). Prints per shape the FP8
floor (one byte a weight), what quantizing the activations costs in accuracy (relative error of
the product against unquantized activations, per token, per 128-wide slice and with a second
term), the best of each family and the fastest six; then per shape the fastest FP8 variant over
the rows up to the FP8 decode-row limit (64): in token_fp8, and of any fp8_mode (the entry
decode_linear_config.TUNED_FP8 would hold).
--fp8-prefill: at --prefill-rows rows (8,192), bf16 F.linear against the FP8 path as the model
runs it, _scaled_mm alone, the activation quantization alone and the bias add, per shape and
per prefill (times the layers).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_sweep import linear_shapes, time_per_call  # noqa: E402

from radixserve.bench_one_batch import measure_copy_bandwidth  # noqa: E402
from radixserve.kernels.decode_linear_config import FP8_MODES  # noqa: E402
from radixserve.kernels.decode_linear_fp8 import tile_quantized_reference  # noqa: E402
from radixserve.model.config import ModelConfig  # noqa: E402
from radixserve.model.layers.linear import FP8_DECODE_ROWS_FACTOR  # noqa: E402
from radixserve.settings import DECODE_GEMM_MAX_ROWS  # noqa: E402


def tma_kernel():
    """The same GEMV with the weight tile loaded by a TMA descriptor (None if this Triton lacks it)."""
    try:
        import triton
        import triton.language as tl
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None

    @triton.jit
    def kernel(X, w_desc, Y, M, N, K, stride_xm, tiles_per_split, WRITE_PARTIAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        first = pid_s * tiles_per_split
        n_tiles = tl.minimum(tiles_per_split, K // BLOCK_K - first)
        k0 = first * BLOCK_K
        mask_m = offs_m < M
        x_ptrs = X + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in range(0, n_tiles):
            w = w_desc.load([pid_n * BLOCK_N, k0 + i * BLOCK_K])
            x = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
            acc = tl.dot(w, x, acc)
            x_ptrs += BLOCK_K
        mask = (offs_n < N)[:, None] & mask_m[None, :]
        if WRITE_PARTIAL:
            tl.store(Y + (pid_s * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=mask)
        else:
            tl.store(Y + offs_m[None, :] * N + offs_n[:, None], acc.to(Y.dtype.element_ty), mask=mask)

    return kernel, TensorDescriptor


def sweep_bf16(args: argparse.Namespace, dev: torch.device, bw: float) -> None:
    """The bf16 decode-row GEMM against cuBLAS (the default mode)."""
    import triton

    from radixserve.kernels.activation import silu_and_mul
    from radixserve.kernels.decode_linear import _reduce, decode_linear
    from radixserve.kernels.decode_linear_config import DecodeLinearConfig, block_m_for, supported

    tma = tma_kernel()
    if tma is not None:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    out: list[dict] = []
    summary: list[str] = []
    grid_cfg = list(itertools.product((64, 128), (128, 256), (3, 5), (4,)))
    for path in args.models:
        cfg = ModelConfig.from_dir(path)
        name = Path(path).name
        for layer, n, k, has_bias in linear_shapes(cfg):
            if args.layers and layer not in args.layers:
                continue
            copies = max(2, min(64, -(-(384 << 20) // (2 * n * k))))
            weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
            b = torch.randn(n, dtype=torch.bfloat16, device=dev) if has_bias else None
            gated = args.silu_mul and layer == "gate_up"
            for m in args.rows:
                x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
                full = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                y = torch.empty(m, n // 2, dtype=torch.bfloat16, device=dev) if gated else full
                ref = (x.float() @ weights[0].float().T + (b.float() if b is not None else 0)).to(torch.bfloat16)
                if gated:
                    ref = silu_and_mul(ref)
                floor_ms = (n * k + m * k + m * y.shape[1]) * 2 / bw * 1e3
                if gated:
                    calls = [lambda w=w: silu_and_mul(torch.matmul(x, w.T, out=full), out=y) for w in weights]
                else:
                    calls = [lambda w=w: torch.matmul(x, w.T, out=y) if b is None else torch.addmm(b, x, w.T, out=y)
                             for w in weights]
                calls[0]()
                torch.cuda.synchronize()
                cublas = time_per_call(calls)
                results = []
                for bn, bk, st, wp in grid_cfg:
                    k_tiles = k // bk
                    splits = sorted({s for s in (1, 2, 3, 4, 6, 8, 12, 16) if k_tiles // s >= 2})
                    for s in splits:
                        c = DecodeLinearConfig(block_n=bn, block_k=bk, split=s, num_warps=wp, num_stages=st)
                        if not supported(weights[0], c):
                            continue
                        part = torch.empty(max(1, s * m * n), dtype=torch.float32, device=dev)
                        label = f"bn={bn} bk={bk} st={st} w={wp} split={s}"
                        try:
                            got = decode_linear(x, weights[0], b, c, out=y, partial=part, silu_mul=gated)
                            torch.cuda.synchronize()
                            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                            if not err < 2e-2:
                                print(f"  WRONG {label}: rel err {err:.3g}", flush=True)
                                continue
                            ms = time_per_call([lambda w=w: decode_linear(x, w, b, c, out=y, partial=part,
                                                                          silu_mul=gated) for w in weights])
                        except Exception as e:  # shared memory too small for the tile, etc.
                            print(f"  skip {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                            continue
                        results.append((label, ms))
                        if tma is not None and b is None and not gated and s in splits[:1] + splits[-2:]:
                            kern, desc_cls = tma
                            bm = block_m_for(m)
                            try:
                                descs = [desc_cls.from_tensor(w, [bn, bk]) for w in weights]
                                k_tiles = k // bk
                                tps = triton.cdiv(k_tiles, s)
                                ss = triton.cdiv(k_tiles, tps)

                                def tma_call(d, tps=tps, ss=ss, bn=bn, bk=bk, st=st, wp=wp, bm=bm):
                                    dst = part if ss > 1 else y
                                    kern[(triton.cdiv(n, bn), ss, 1)](x, d, dst, m, n, k, x.stride(0), tps,
                                                                     WRITE_PARTIAL=ss > 1, BLOCK_M=bm, BLOCK_N=bn,
                                                                     BLOCK_K=bk, num_warps=wp, num_stages=st)
                                    if ss > 1:
                                        blk = min(1024, triton.next_power_of_2(n))
                                        _reduce[(m, triton.cdiv(n, blk))](part, weights[0], y, m, n, y.stride(0),
                                                                         ss, HAS_BIAS=False, GATED=False, BLOCK=blk,
                                                                         num_warps=4)

                                tma_call(descs[0])
                                torch.cuda.synchronize()
                                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                                if err < 2e-2:
                                    results.append((label + " tma", time_per_call([lambda d=d: tma_call(d)
                                                                                   for d in descs])))
                                else:
                                    print(f"  WRONG tma {label}: rel err {err:.3g}", flush=True)
                            except Exception as e:
                                print(f"  skip tma {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        del part
                results.sort(key=lambda r: r[1])
                best = results[0] if results else ("-", float("nan"))
                line = (f"{name} {layer + ('+silu' if gated else ''):8s} M={m:3d} N={n:6d} K={k:6d} floor {floor_ms * 1e3:7.1f} us | cublas "
                        f"{cublas * 1e3:7.1f} ({cublas / floor_ms:.2f}x) | best {best[1] * 1e3:7.1f} "
                        f"({best[1] / floor_ms:.2f}x, {cublas / best[1]:.2f}x faster) {best[0]}")
                print(line + " | next: " + "; ".join(f"{lab} {t * 1e3:.1f}" for lab, t in results[1:4]), flush=True)
                summary.append(line)
                out.append(dict(model=name, layer=layer, m=m, n=n, k=k, floor_ms=floor_ms, cublas_ms=cublas,
                                results=[dict(variant=v, ms=t) for v, t in results]))
                if args.json:
                    Path(args.json).write_text(json.dumps(dict(bandwidth=bw, rows=out), indent=1))
            del weights
            torch.cuda.empty_cache()
    print("\n# summary")
    print("\n".join(summary))


# --------------------------------------------------------------------------- FP8 weights
# The activation dtype of the FP8 rows (bf16, as the model runs them).
ACT = torch.bfloat16
# The FP8 decode-row GEMM's tiles (BLOCK_N, BLOCK_K, stages, warps): with one byte a weight, a
# BLOCK_K of 256 puts the bytes of a bf16 128-wide tile in flight, 512 twice that. Each runs at
# K splits of FP8_SPLITS (a tile too big for shared memory gets fewer stages, or is skipped).
FP8_GRID = [(64, 256, 3, 4), (64, 256, 5, 4), (128, 256, 4, 8), (64, 512, 3, 4), (64, 512, 4, 8),
            (32, 512, 4, 4)]
# The other ways of multiplying (FP8 activations quantized per token in front, timed with and
# without that quantization; quantized per K slice in the kernel, in one e4m3 term and in two; the
# fp16 dot, on two of them), on fewer tiles.
# Wider strips amortize the in-kernel quantization of the x tile over more weight rows.
FP8_MODE_GRID = [(64, 128, 5, 4), (128, 128, 4, 4), (128, 256, 4, 8)]
FP8_SPLITS = (1, 2, 4, 8)
FP8_TOL = 2e-2  # relative error against the variant's own reference (bf16 output rounding)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def fp8_shapes(cfg: ModelConfig, layers) -> list[tuple[str, int, int, bool]]:
    return [s for s in linear_shapes(cfg) if s[0] != "lm_head" and (not layers or s[0] in layers)]


class Variants:
    """Checks each variant's first call against its reference, then times it over the weight copies
    (time_per_call); keeps (label, ms, family, config) for the ones that ran and were right."""

    def __init__(self, copies: int):
        self.copies = copies
        self.results: list[tuple[str, float, str, Optional[tuple]]] = []

    def run(self, label: str, family: str, make_call, ref: torch.Tensor, config: Optional[tuple] = None) -> None:
        if any(r[0] == label for r in self.results):
            return
        try:
            got = make_call(0)()
            torch.cuda.synchronize()
            err = rel_err(got, ref)
            if not err < FP8_TOL:
                print(f"  WRONG {label}: rel err {err:.3g}", flush=True)
                return
            ms = time_per_call([make_call(i) for i in range(self.copies)])
        except Exception as e:  # a tile that does not fit in shared memory, an M _scaled_mm refuses
            print(f"  skip {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            return
        self.results.append((label, ms, family, config))

    def best(self, family: Optional[str] = None) -> tuple[str, float, str, Optional[tuple]]:
        rows = [r for r in self.results if family is None or r[2] == family]
        return min(rows, key=lambda r: r[1]) if rows else ("-", float("nan"), "", None)


def scaled_mm_rows(x: torch.Tensor) -> torch.Tensor:
    """x as torch._scaled_mm takes it: unchanged, or its rows padded to a multiple of 16 on a torch
    that refuses other M (the padding rows are zeros)."""
    try:
        torch._scaled_mm(torch.zeros(x.shape[0], 16, dtype=torch.float8_e4m3fn, device=x.device),
                         torch.zeros(16, 16, dtype=torch.float8_e4m3fn, device=x.device).t(),
                         scale_a=torch.ones(x.shape[0], 1, device=x.device),
                         scale_b=torch.ones(1, 16, device=x.device), out_dtype=ACT)
        return x
    except RuntimeError:
        padded = torch.zeros(-(-x.shape[0] // 16) * 16, x.shape[1], dtype=x.dtype, device=x.device)
        padded[:x.shape[0]] = x
        return padded


def fp8_decode_variants(v: Variants, x: torch.Tensor, w16: list, w8: list, b: Optional[torch.Tensor], gated: bool,
                        refs: dict, part: torch.Tensor, y: torch.Tensor) -> None:
    """The baselines of one shape at one M: bf16 (our kernel, tuned; cuBLAS), the FP8 kernel as
    the model runs it today, and torch._scaled_mm the ways it can run."""
    from radixserve.kernels.activation import silu_and_mul
    from radixserve.kernels.decode_linear import decode_linear
    from radixserve.kernels.decode_linear_config import config_for
    from radixserve.kernels.decode_linear_fp8 import decode_linear_fp8
    from radixserve.kernels.quant_fp8 import quantize_rows_fp8
    from radixserve.model.layers.fp8 import fp8_linear_scaled_mm

    m = x.shape[0]
    post = (lambda t: silu_and_mul(t, out=y)) if gated else (lambda t: t)
    c16 = config_for(w16[0])
    if c16 is not None:
        v.run(f"bf16 tuned {cfg_label(c16)}", "bf16", lambda i: lambda: decode_linear(
            x, w16[i % len(w16)], b, c16, out=y, partial=part, silu_mul=gated), refs["bf16"])
    v.run("bf16 cublas", "bf16", lambda i: lambda: post(
        torch.matmul(x, w16[i % len(w16)].T) if b is None else torch.addmm(b, x, w16[i % len(w16)].T)), refs["bf16"])
    c8 = config_for(w8[0][0])
    if c8 is not None:
        v.run(f"fp8 current {c8.fp8_mode} {cfg_label(c8)}", "fp8 current", lambda i: lambda: decode_linear_fp8(
            x, *w8[i], b, c8, out=y, partial=part, silu_mul=gated), mode_ref(refs, c8), config=cfg_tuple(c8))
    xs = scaled_mm_rows(x)
    pad = " (M padded to 16)" if xs.shape[0] != m else ""
    cut = (lambda t: post(t[:m])) if pad else post
    v.run("scaled_mm, one-kernel quant" + pad, "scaled_mm", lambda i: lambda: cut(fp8_linear_scaled_mm(
        xs, *w8[i], b, None, fused_quant=True)), refs["q"])
    v.run("scaled_mm, torch-op quant" + pad, "scaled_mm", lambda i: lambda: cut(fp8_linear_scaled_mm(
        xs, *w8[i], b, None, fused_quant=False)), refs["q"])
    xq, x_scale = quantize_rows_fp8(xs)

    def mm(i: int, fast: bool, with_bias: bool):
        w, s = w8[i]
        return lambda: cut(torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=s[None, :], out_dtype=ACT,
                                            bias=b if with_bias else None, use_fast_accum=fast))
    ref_mm = refs["q"] if b is None else refs["q_nobias"]
    v.run("scaled_mm alone (pre-quantized)" + pad, "scaled_mm alone", lambda i: mm(i, False, False), ref_mm)
    v.run("scaled_mm alone, fast accum" + pad, "scaled_mm alone", lambda i: mm(i, True, False), ref_mm)
    if b is not None:
        v.run("scaled_mm alone, bias in the GEMM" + pad, "scaled_mm alone", lambda i: mm(i, False, True), refs["q"])


def mode_ref(refs: dict, c) -> torch.Tensor:
    """The reference of what config c's fp8_mode multiplies: x quantized per token, per K tile
    (in one e4m3 term or two), or x itself."""
    if c.fp8_mode == "token_fp8":
        return refs["q"]
    if c.fp8_mode.startswith("tile"):
        return refs["tile"](c.block_k, 2 if c.fp8_mode == "tile_fp8x2" else 1)
    return refs["x"]


def cfg_tuple(c) -> tuple:
    return (c.block_n, c.block_k, c.split, c.num_warps, c.num_stages, c.fp8_mode)


def cfg_label(c) -> str:
    return f"bn={c.block_n} bk={c.block_k} st={c.num_stages} w={c.num_warps} split={c.split}"


def fp8_grid_variants(v: Variants, x: torch.Tensor, w8: list, b: Optional[torch.Tensor], gated: bool, refs: dict,
                      part: torch.Tensor, y: torch.Tensor, deadline: float) -> None:
    """The FP8 decode-row GEMM over FP8_MODE_GRID in token_fp8 (and on pre-quantized activations),
    over FP8_GRID widened to bf16, then FP8_MODE_GRID with FP8 activations per K tile and the fp16
    dot; until `deadline` (time.monotonic())."""
    from radixserve.kernels.decode_linear_config import DecodeLinearConfig, block_m_for, pipeline_stages, supported
    from radixserve.kernels.decode_linear_fp8 import decode_linear_fp8
    from radixserve.kernels.quant_fp8 import quantize_rows_fp8

    m, k = x.shape
    xq, x_scale = quantize_rows_fp8(x)
    modes = [("fp8 token", FP8_MODE_GRID, "token_fp8"), ("fp8 widen", FP8_GRID, "widen"),
             ("fp8 tile-act", FP8_MODE_GRID, "tile_fp8"), ("fp8 tile-act x2", FP8_MODE_GRID, "tile_fp8x2"),
             ("fp8 fp16-dot", FP8_MODE_GRID[:2], "fp16")]
    for family, grid, mode in modes:
        for bn, bk, st, wp in grid:
            if k % bk:
                continue
            for split in FP8_SPLITS:
                if k // bk // split < 2 or time.monotonic() > deadline:
                    continue
                c = DecodeLinearConfig(bn, bk, split, wp, st, mode)
                if not supported(w8[0][0], c):
                    continue
                # The stages that run (fewer where the tiles would overflow shared memory).
                c = replace(c, num_stages=pipeline_stages(c, block_m_for(m), 1 if mode == "token_fp8" else 2, 1))

                def call(i, c=c):
                    return lambda: decode_linear_fp8(x, *w8[i], b, c, out=y, partial=part, silu_mul=gated)
                v.run(f"{family} {cfg_label(c)}", family, call, mode_ref(refs, c), config=cfg_tuple(c))
                if mode == "token_fp8":  # the GEMM alone, as if the op before had quantized x
                    def call_prequantized(i, c=c):
                        return lambda: decode_linear_fp8(xq, *w8[i], b, c, out=y, partial=part, silu_mul=gated,
                                                         x_scale=x_scale)
                    v.run(f"{family} pre-quantized {cfg_label(c)}", family + " pre-quantized", call_prequantized,
                          refs["q"])
    del xq, x_scale


# The families each summary line shows the best of (best_us).
FP8_FAMILIES = ("bf16", "fp8 current", "scaled_mm", "scaled_mm alone", "fp8 token", "fp8 token pre-quantized",
                "fp8 widen", "fp8 tile-act", "fp8 tile-act x2", "fp8 fp16-dot")


def best_us(v: Variants, family: str, floor_ms: float) -> str:
    label, ms, _, _ = v.best(family)
    return "-" if label == "-" else f"{ms * 1e3:7.1f} us ({ms / floor_ms:.2f}x)"


def sweep_fp8(cfg: ModelConfig, name: str, rows: list[int], layers, budget_s: float, dev: torch.device,
              out: list[dict], json_path: Optional[str], bw: float) -> None:
    """Per projection and M: the FP8 floor, the bf16 baselines, the FP8 kernel as configured today,
    torch._scaled_mm, and the FP8 kernel's grids; then the fastest FP8 decode-kernel tile per shape
    over the rows up to the FP8 decode-row limit (what `TUNED_FP8` would hold)."""
    from radixserve.kernels.activation import silu_and_mul
    from radixserve.model.layers.fp8 import quantize_activations, quantize_rows

    shapes = fp8_shapes(cfg, layers)
    start = time.monotonic()
    summary: list[str] = []
    for idx, (layer, n, k, has_bias) in enumerate(shapes):
        deadline = start + budget_s * (idx + 1) / len(shapes)
        gated = layer == "gate_up"
        n_out = n // 2 if gated else n
        # Each set of copies far bigger than the L2 cache, as a model's layers are.
        copies = max(2, min(64, -(-(384 << 20) // (n * k))))  # of the FP8 weights; half as many bf16
        w16 = [torch.randn(n, k, dtype=ACT, device=dev) * 0.02 for _ in range(max(2, copies // 2))]
        w8 = [quantize_rows(torch.randn(n, k, dtype=ACT, device=dev) * 0.02) for _ in range(copies)]
        b = torch.randn(n, dtype=ACT, device=dev) if has_bias else None
        deq = w8[0][0].float() * w8[0][1][:, None]
        by_config: dict[tuple, dict[int, float]] = {}
        for m in rows:
            x = torch.randn(m, k, dtype=ACT, device=dev)
            xq, x_scale = quantize_activations(x, None)
            bias = b.float() if b is not None else 0.0
            raw = {"bf16": x.float() @ w16[0].float().T + bias, "x": x.float() @ deq.T + bias,
                   "q": (xq.float() * x_scale) @ deq.T + bias, "q_nobias": (xq.float() * x_scale) @ deq.T}
            post = (lambda r: silu_and_mul(r.to(ACT))) if gated else (lambda r: r.to(ACT))  # noqa: E731
            refs = {key: post(r) for key, r in raw.items()}
            refs["tile"] = functools.lru_cache(None)(
                lambda bk, terms, x=x, bias=bias, post=post:
                post(tile_quantized_reference(x, bk, terms, torch.float32) @ deq.T + bias))
            # What quantizing the activations costs in accuracy: against the unquantized x.
            act_err = (f"act err per token {rel_err(refs['q'], refs['x']):.4f}, per 128 slice "
                       f"{rel_err(refs['tile'](128, 1), refs['x']):.4f}, two terms "
                       f"{rel_err(refs['tile'](128, 2), refs['x']):.4f}")
            y = torch.empty(m, n_out, dtype=ACT, device=dev)
            part = torch.empty(max(FP8_SPLITS) * 2 * m * n, dtype=torch.float32, device=dev)
            v = Variants(len(w8))
            fp8_decode_variants(v, x, w16, w8, b, gated, refs, part, y)
            fp8_grid_variants(v, x, w8, b, gated, refs, part, y, deadline)
            floor8 = (n * k + (m * k + m * n_out) * 2) / bw * 1e3
            floor16 = (n * k + m * k + m * n_out) * 2 / bw * 1e3
            head = f"{name} {layer + ('+silu' if gated else ''):12s} M={m:3d} N={n:6d} K={k:6d}"
            line = (f"{head} fp8 floor {floor8 * 1e3:6.1f} us (bf16 {floor16 * 1e3:6.1f}, {act_err}) | "
                    + " | ".join(f"{fam} {best_us(v, fam, floor8)}" for fam in FP8_FAMILIES)
                    + f" | best {v.best()[0]}")
            ranked = sorted(v.results, key=lambda r: r[1])
            print(line + "\n    top: " + "; ".join(f"{r[0]} {r[1] * 1e3:.1f}" for r in ranked[:6]), flush=True)
            summary.append(line)
            for _label, ms, _family, config in v.results:
                if config is not None:  # the FP8 kernel as the model can run it
                    by_config.setdefault(config, {})[m] = ms
            out.append(dict(kind="fp8", model=name, layer=layer, m=m, n=n, k=k, floor_ms=floor8,
                            bf16_floor_ms=floor16, results=[dict(variant=r[0], family=r[2], ms=r[1]) for r in ranked]))
            if json_path:
                Path(json_path).write_text(json.dumps(dict(bandwidth=bw, rows=out), indent=1))
            del part
        small = [m for m in rows if m <= FP8_DECODE_ROWS_FACTOR * DECODE_GEMM_MAX_ROWS]
        full = [cfg for cfg, t in by_config.items() if all(m in t for m in small)]
        for mode in (("token_fp8",), FP8_MODES):
            fits = [cfg for cfg in full if cfg[-1] in mode]
            if small and fits:
                bn, bk, split, wp, st, fp8_mode = min(fits, key=lambda cfg: sum(by_config[cfg][m] for m in small))
                total = sum(by_config[(bn, bk, split, wp, st, fp8_mode)][m] for m in small) * 1e3
                summary.append(f"{name} {layer}: fastest FP8 decode variant over M={small} ({'/'.join(mode)}), "
                               f"{total:.1f} us summed: TUNED_FP8[({n}, {k})] = "
                               f"DecodeLinearConfig({bn}, {bk}, {split}, {wp}, {st}, {fp8_mode!r})")
        del w16, w8, deq
        torch.cuda.empty_cache()
    print("\n# summary (fp8)\n" + "\n".join(summary), flush=True)


def sweep_fp8_prefill(cfg: ModelConfig, name: str, m: int, layers, dev: torch.device, out: list[dict],
                      json_path: Optional[str], bw: float) -> None:
    """Where an FP8 prefill's projection time goes, at m rows: bf16 F.linear; the FP8 path as the
    model runs it (one-kernel quantization + _scaled_mm + bias), and as it ran with torch-op
    quantization; _scaled_mm alone on pre-quantized inputs (with and without fast accumulation);
    the quantization alone both ways; the bias add. Per shape, then per prefill (x layers)."""
    import torch.nn.functional as F

    from radixserve.kernels.quant_fp8 import quantize_rows_fp8
    from radixserve.model.layers.fp8 import fp8_linear_scaled_mm, quantize_activations, quantize_rows

    totals: dict[str, float] = {}
    for layer, n, k, has_bias in fp8_shapes(cfg, layers):
        w16 = [torch.randn(n, k, dtype=ACT, device=dev) * 0.02 for _ in range(2)]
        w8 = [quantize_rows(w) for w in w16]
        b = torch.randn(n, dtype=ACT, device=dev) if has_bias else None
        x = torch.randn(m, k, dtype=ACT, device=dev)
        xq, x_scale = quantize_rows_fp8(x)
        y = fp8_linear_scaled_mm(x, *w8[0], b, None, fused_quant=True)
        ref = (xq.float() * x_scale) @ (w8[0][0].float() * w8[0][1][:, None]).T + (b.float() if b is not None else 0)
        err = rel_err(y, ref)
        del ref
        calls = {
            "bf16 F.linear": lambda w: lambda: F.linear(x, w16[w], b),
            "fp8 model path": lambda w: lambda: fp8_linear_scaled_mm(x, *w8[w], b, None, fused_quant=True),
            "fp8 model path, torch-op quant": lambda w: lambda: fp8_linear_scaled_mm(x, *w8[w], b, None),
            "scaled_mm alone": lambda w: lambda: torch._scaled_mm(xq, w8[w][0].t(), scale_a=x_scale,
                                                                  scale_b=w8[w][1][None, :], out_dtype=ACT),
            "scaled_mm alone, fast accum": lambda w: lambda: torch._scaled_mm(
                xq, w8[w][0].t(), scale_a=x_scale, scale_b=w8[w][1][None, :], out_dtype=ACT, use_fast_accum=True),
            "quant one kernel": lambda w: lambda: quantize_rows_fp8(x),
            "quant torch ops": lambda w: lambda: quantize_activations(x, None),
        }
        if b is not None:
            calls["bias add"] = lambda w: lambda: y + b
        flops = 2 * m * n * k
        # Bytes the memory-bound steps must move at least (the rest are GEMMs: FLOP/s).
        moved = {"quant one kernel": m * k * 3, "quant torch ops": m * k * 3, "bias add": m * n * 4}
        results = {}
        for label, make in calls.items():
            try:
                make(0)()
                torch.cuda.synchronize()
                results[label] = time_per_call([make(i % 2) for i in range(4)], replays=5)
            except Exception as e:
                print(f"  skip {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            totals[label] = totals.get(label, 0.0) + results[label] * cfg.num_hidden_layers
        rate = lambda lab: (f"{results[lab] * 1e3:8.1f} us"  # noqa: E731
                            + (f" ({moved[lab] / results[lab] / 1e9:5.0f} GB/s)" if lab in moved
                               else f" ({flops / results[lab] / 1e9:5.0f} TFLOP/s)"))
        print(f"{name} prefill {layer:8s} M={m} N={n:6d} K={k:6d} (fp8 path rel err {err:.2g}) | "
              + " | ".join(f"{lab} {rate(lab)}" for lab in results), flush=True)
        out.append(dict(kind="fp8_prefill", model=name, layer=layer, m=m, n=n, k=k, rel_err=err,
                        results=[dict(variant=lab, ms=t) for lab, t in results.items()]))
        if json_path:
            Path(json_path).write_text(json.dumps(dict(bandwidth=bw, rows=out), indent=1))
        del w16, w8, x, xq, y
        torch.cuda.empty_cache()
    print(f"{name} prefill of {m} tokens, projections x {cfg.num_hidden_layers} layers (SiLU, attention and the "
          "rest not counted): " + "; ".join(f"{lab} {t:.1f} ms" for lab, t in totals.items()), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--layers", nargs="+", default=None, help="only these projections (qkv o gate_up down lm_head)")
    p.add_argument("--silu-mul", action="store_true",
                   help="gate_up with the fused silu(gate) * up epilogue (cuBLAS: matmul + silu_and_mul)")
    p.add_argument("--fp8", action="store_true",
                   help="e4m3 weights instead: the FP8 decode-row GEMM's variants and torch._scaled_mm "
                        "(gate_up always with the fused SiLU; lm_head, which stays bf16, left out)")
    p.add_argument("--fp8-prefill", action="store_true",
                   help="where an FP8 prefill's projection time goes, at --prefill-rows rows")
    p.add_argument("--prefill-rows", type=int, default=8192)
    p.add_argument("--grid-budget-s", type=float, default=300.0,
                   help="--fp8: seconds for the config grids over all shapes (each shape its share; the "
                        "baselines always run)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    bw = measure_copy_bandwidth(dev)
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if not (args.fp8 or args.fp8_prefill):
        sweep_bf16(args, dev, bw)
        return 0
    out: list[dict] = []
    for path in args.models:
        cfg = ModelConfig.from_dir(path)
        if args.fp8_prefill:
            sweep_fp8_prefill(cfg, Path(path).name, args.prefill_rows, args.layers, dev, out, args.json, bw)
        if args.fp8:
            sweep_fp8(cfg, Path(path).name, args.rows, args.layers, args.grid_budget_s, dev, out, args.json, bw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
