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
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_sweep import linear_shapes, time_per_call  # noqa: E402

from radixserve.bench_one_batch import measure_copy_bandwidth  # noqa: E402
from radixserve.model.config import ModelConfig  # noqa: E402


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--layers", nargs="+", default=None, help="only these projections (qkv o gate_up down lm_head)")
    p.add_argument("--silu-mul", action="store_true",
                   help="gate_up with the fused silu(gate) * up epilogue (cuBLAS: matmul + silu_and_mul)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from radixserve.kernels.activation import silu_and_mul
    from radixserve.kernels.decode_linear import _reduce, decode_linear
    from radixserve.kernels.decode_linear_config import DecodeLinearConfig, block_m_for, supported

    dev = torch.device("cuda")
    bw = measure_copy_bandwidth(dev)
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
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
                                                                         ss, HAS_BIAS=False, BLOCK=blk, num_warps=4)

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
