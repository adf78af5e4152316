"""Sweep of the fused MoE's grouped GEMMs (radixserve.kernels.fused_moe) over tiles, on a GPU.

    python scripts/fused_moe_sweep.py --shapes qwen3-30b-a3b qwen2-57b-a14b --tokens 1 16 64 256 1024 4096 \
        --tp 1 2 --json moe.json

For each model shape (routed experts, top-k, hidden, moe_intermediate; at each --tp, the rank's
slice of the intermediate), each number of tokens T (random routing, as a random router gives)
and each BLOCK_M (both GEMMs of a step walk one alignment, so they share it): the gate|up GEMM
(SiLU fused) and the down GEMM (routing weights fused) over a grid of BLOCK_N x BLOCK_K, GROUP_M,
warps and stages, each timed with triton.testing.do_bench (L2 flushed between calls: the weights
come from HBM, as in a decode step). Prints per (shape, T) the best pair with its time and the
default config's, and the `TUNED` entries (radixserve.kernels.fused_moe_config) those choices
make.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.kernels.fused_moe import moe_align, moe_gemm  # noqa: E402
from radixserve.kernels.fused_moe_config import FusedMoeConfig, default_config  # noqa: E402
from radixserve.model.layers.moe import route_reference  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen2-57b-a14b": (64, 8, 3584, 2560)}


def block_ms(rows_per_expert: float) -> list[int]:
    if rows_per_expert <= 4:
        return [16]
    if rows_per_expert <= 16:
        return [16, 32]
    if rows_per_expert <= 64:
        return [16, 32, 64]
    return [32, 64, 128]


def grid(block_m: int, many_tiles: bool) -> list[FusedMoeConfig]:
    out = []
    # Narrow N tiles for the few rows of a decode step: more programs stream each expert's weights.
    for bn, bk, stages in itertools.product((32, 64, 128) if block_m == 16 else (64, 128), (64, 128), (3, 4, 5)):
        for warps in ((4,) if block_m <= 32 else (4, 8)):
            for group in ((1, 8) if many_tiles else (1,)):
                out.append(FusedMoeConfig(block_m, bn, bk, group, warps, stages))
    return out


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25) * 1e3  # us


def sweep_one(e: int, k: int, h: int, inter: int, t: int, seed: int = 0) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(e, h, inter, device=dev, generator=g) * 0.02).bfloat16()
    x = torch.randn(t, h, device=dev, generator=g).bfloat16()
    weights, ids = route_reference(torch.randn(t, e, device=dev, generator=g), k, True)
    weights, ids = weights.bfloat16().reshape(-1), ids.int()
    inter_buf = torch.empty(t * k, inter, device=dev, dtype=torch.bfloat16)
    down = torch.empty(t * k, h, device=dev, dtype=torch.bfloat16)
    rows = t * k / e
    best = None
    for bm in block_ms(rows):
        sorted_ids, expert_ids, total = moe_align(ids, e, bm)
        many = expert_ids.numel() > 64
        t13, t2 = [], []
        for c in grid(bm, many):
            try:
                t13.append((bench(lambda: moe_gemm(x, w13, inter_buf, sorted_ids, expert_ids, total, c, rows_per_a=k,
                                                   gated=True)), c))
                t2.append((bench(lambda: moe_gemm(inter_buf, w2, down, sorted_ids, expert_ids, total, c,
                                                  rows_per_a=1, gated=False, routed_weights=weights)), c))
            except Exception as err:  # a tile that does not compile (shared memory): skip it
                print(f"  skip {c}: {type(err).__name__}", file=sys.stderr)
        b13, b2 = min(t13, key=lambda p: p[0]), min(t2, key=lambda p: p[0])
        if best is None or b13[0] + b2[0] < best["us"]:
            best = {"us": b13[0] + b2[0], "gate_up_us": b13[0], "down_us": b2[0], "gate_up": b13[1], "down": b2[1]}
    d13, d2 = default_config(e, 2 * inter, h, t, k), default_config(e, h, inter, t, k)
    d2 = replace(d2, block_m=d13.block_m)
    sorted_ids, expert_ids, total = moe_align(ids, e, d13.block_m)
    default_us = bench(lambda: moe_gemm(x, w13, inter_buf, sorted_ids, expert_ids, total, d13, rows_per_a=k,
                                        gated=True)) + \
        bench(lambda: moe_gemm(inter_buf, w2, down, sorted_ids, expert_ids, total, d2, rows_per_a=1, gated=False,
                               routed_weights=weights))
    touched = int(torch.unique(ids).numel())
    best["default_us"] = default_us
    best["touched_experts"] = touched
    best["floor_us"] = touched * 3 * inter * h * 2 / 4.3e12 * 1e6  # the touched experts' bytes at ~4.3 TB/s
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64, 256, 1024, 4096])
    ap.add_argument("--tp", nargs="+", type=int, default=[1])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results = []
    tuned: dict[tuple[int, int, int], list] = {}
    for name, tp, t in itertools.product(args.shapes, args.tp, args.tokens):
        e, k, h, inter = SHAPES[name]
        inter //= tp
        r = sweep_one(e, k, h, inter, t)
        print(f"{name} tp{tp} T={t:5d}: best {r['us']:8.1f} us (gate_up {r['gate_up_us']:.1f}, down "
              f"{r['down_us']:.1f}), default {r['default_us']:8.1f} us, floor {r['floor_us']:.1f} us "
              f"({r['touched_experts']} experts); {r['gate_up']} / {r['down']}", flush=True)
        results.append({"shape": name, "tp": tp, "tokens": t, **{key: (asdict(v) if isinstance(v, FusedMoeConfig)
                                                                      else v) for key, v in r.items()}})
        tuned.setdefault((e, 2 * inter, h), []).append((t, r["gate_up"]))
        tuned.setdefault((e, h, inter), []).append((t, r["down"]))
    print("\nTUNED = {")
    for key, buckets in tuned.items():
        print(f"    {key}: (")
        for t, c in buckets:
            print(f"        ({t}, FusedMoeConfig({c.block_m}, {c.block_n}, {c.block_k}, {c.group_m}, {c.num_warps}, "
                  f"{c.num_stages})),")
        print("    ),")
    print("}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
