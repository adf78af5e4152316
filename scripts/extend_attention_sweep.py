"""Time the extend attention kernel's variants against the per-head kernel it replaced (and
FlashAttention-3, when vLLM's bundle is importable) at the shapes that matter, on one GPU.

    python scripts/extend_attention_sweep.py                 # the table below, ~2 minutes on an H200
    python scripts/extend_attention_sweep.py --print-table   # + the best config per head dim, as TUNED takes it
    python scripts/extend_attention_sweep.py --kv fp8        # the same over an FP8 (e4m3) pool
    TRITON_INTERPRET=1 python scripts/extend_attention_sweep.py --dry-run   # the script's logic on a CPU

Shapes (one layer): Qwen2-7B (28 query heads over 4 KV heads, head dim 128) at 1 x (7168 cached
+ 1024 new), 16 x (1024 + 128) and 1 x 8192 new; Qwen3.5-27B's gated attention (24 over 4, head dim
256, from benchmarks/configs/qwen3.5-27b) at 16 x (1024 + 128). The pool is page size 1 with
every request's slots scattered at random over 512k slots, as the radix cache leaves them.

Each time is the median of CUDA-graph replays of the attention launches alone (the extend kernel,
and the merge kernel when prefixes are split), the L2 cache flushed before each
(triton.testing.do_bench). The floor is the FLOPs (4 x Hq x D x (E x P + E(E+1)/2) per request,
causal counted once) at the bf16 matmul rate measured first (8192^3 torch.matmul, burst). err:
relative error against the per-head kernel's output (BAD above 2e-2). --dry-run: tiny shapes and
three variants on the CPU through Triton's interpreter (fp16, wall-clock times that mean nothing),
to check the script before it spends device time.

Every variant is compiled first in parallel child processes (one per variant, into Triton's
on-disk cache), so compiling costs wall time once and a variant whose compile fails or crashes
is reported and skipped instead of ending the sweep.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from radixserve.kernels.extend_attention_config import TUNED, ExtendAttentionConfig  # noqa: E402

TABLE_WIDTH = 8256  # req_to_token columns: the same for every shape (Triton specialises on it)
# Where problems live; --dry-run swaps in the CPU (Triton's interpreter), fp16 and a small pool.
ENV = {"device": "cuda", "dtype": torch.bfloat16, "pool_slots": 512 * 1024, "dry": False}
SPLITS = (0, 2, 4, 8)  # split_programs_per_sm values timed for the shapes with a prefix


@dataclass(frozen=True)
class Shape:
    model: str
    hq: int
    hkv: int
    d: int
    bs: int
    prefix: int
    ext: int

    @property
    def name(self) -> str:
        return f"{self.model} {self.bs}x({self.prefix}+{self.ext})" if self.prefix else \
            f"{self.model} {self.bs}x{self.ext}"

    def flops(self) -> float:
        return self.bs * 4.0 * self.hq * self.d * (self.ext * self.prefix + self.ext * (self.ext + 1) / 2)


def model_heads(name: str, fallback: tuple[int, int, int]) -> tuple[int, int, int]:
    try:
        cfg = json.loads((REPO / "benchmarks/configs" / name / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cfg["num_attention_heads"], cfg["num_key_value_heads"], d
    except (OSError, KeyError, ValueError):
        return fallback


def shapes() -> list[Shape]:
    if ENV["dry"]:
        return [Shape("tiny", 14, 2, 32, 1, 40, 24), Shape("tiny", 14, 2, 32, 3, 20, 9),
                Shape("tiny", 14, 2, 32, 1, 0, 40)]
    q7 = model_heads("qwen2-7b", (28, 4, 128))
    q35 = model_heads("qwen3.5-27b", (24, 4, 256))
    return [Shape("qwen2-7b", *q7, 1, 7168, 1024), Shape("qwen2-7b", *q7, 16, 1024, 128),
            Shape("qwen2-7b", *q7, 1, 0, 8192), Shape("qwen3.5-27b", *q35, 16, 1024, 128)]


def variants(d: int) -> list[ExtendAttentionConfig]:
    """Kernel variants per head dim (each is compiled once; split settings are host-only)."""
    C = ExtendAttentionConfig
    if ENV["dry"]:
        return [C(32, 16, 4, 2, min_split_len=16), C(16, 16, 4, 2, min_split_len=16, prefetch_slots=True),
                C(32, 16, 4, 2, min_split_len=16, tma_new=True)]
    if d <= 128:
        base = [C(128, 64, 8, 3), C(128, 64, 8, 4), C(128, 64, 8, 5), C(128, 128, 8, 2), C(128, 128, 8, 3), C(128, 32, 4, 4),
                C(128, 32, 8, 4), C(64, 64, 4, 3), C(64, 64, 4, 4), C(64, 32, 4, 5),
                C(256, 64, 16, 2), C(256, 64, 16, 3), C(256, 32, 8, 4), C(256, 64, 8, 3),
                C(128, 64, 8, 3, prefetch_slots=True), C(128, 64, 8, 4, prefetch_slots=True),
                C(256, 64, 16, 3, prefetch_slots=True),
                C(128, 64, 8, 3, tma_new=True), C(128, 64, 8, 4, tma_new=True),
                C(128, 64, 8, 3, tma_new=True, warp_specialize=True)]
    else:
        base = [C(64, 32, 4, 2), C(64, 32, 4, 3), C(64, 64, 4, 2), C(128, 32, 8, 2), C(128, 32, 8, 3),
                C(128, 64, 8, 2), C(64, 32, 4, 3, prefetch_slots=True), C(128, 32, 8, 2, tma_new=True)]
    if d in TUNED and TUNED[d] not in base:
        base.insert(0, TUNED[d])
    return base


OLD = {128: [(128, 64, 8, 3), (64, 64, 4, 3)], 256: [(64, 32, 4, 2)], 64: [(128, 64, 4, 3), (64, 64, 4, 3)],
       32: [(32, 16, 4, 2)]}


# ----------------------------------------------------------------------------- one problem

class Problem:
    """One shape's inputs on the GPU: a pool of scattered slots, q/k/v of the new tokens."""

    def __init__(self, shape: Shape, kv: str, seed: int = 0, pool_slots: Optional[int] = None):
        dev = torch.device(ENV["device"])
        dt = ENV["dtype"]
        g = torch.Generator(device=dev)
        g.manual_seed(seed)
        self.shape = shape
        s = shape
        self.kv_dtype = torch.float8_e4m3fn if kv == "fp8" else dt
        slots = pool_slots or ENV["pool_slots"]
        self.k_buf = torch.randn(slots, s.hkv, s.d, device=dev, generator=g, dtype=dt)
        self.v_buf = torch.randn(slots, s.hkv, s.d, device=dev, generator=g, dtype=dt)
        perm = torch.randperm(slots - 1, device=dev, generator=g) + 1
        ctx = s.prefix + s.ext
        assert ctx <= TABLE_WIDTH and s.bs * ctx <= perm.numel()
        self.req_to_token = torch.zeros(s.bs, TABLE_WIDTH, dtype=torch.int64, device=dev)
        self.req_to_token[:, :ctx] = perm[:s.bs * ctx].view(s.bs, ctx)
        t = s.bs * s.ext
        self.q = torch.randn(t, s.hq, s.d, device=dev, generator=g, dtype=dt)
        loc = self.req_to_token[:, s.prefix:ctx].reshape(-1)
        self.k, self.v = self.k_buf[loc].clone(), self.v_buf[loc].clone()  # the pool holds them too
        if self.kv_dtype != dt:
            self.k_buf, self.v_buf = self.k_buf.to(self.kv_dtype), self.v_buf.to(self.kv_dtype)
            self.k = self.k_buf[loc].to(dt)
            self.v = self.v_buf[loc].to(dt)
        self.rows = torch.arange(s.bs, device=dev)
        self.prefix_lens = torch.full((s.bs,), s.prefix, dtype=torch.int64, device=dev)
        self.extend_lens = torch.full((s.bs,), s.ext, dtype=torch.int64, device=dev)
        self.out = torch.empty_like(self.q)

    def new_kernel(self, cfg: ExtendAttentionConfig, num_sms: int) -> Callable[[], object]:
        from radixserve.kernels.extend_attention import extend_attention
        from radixserve.kernels.extend_attention_plan import plan_extend

        s = self.shape
        plan = plan_extend([s.ext] * s.bs, [s.prefix] * s.bs, group=s.hq // s.hkv, block_m=cfg.block_m,
                           block_n=cfg.block_n, device=ENV["device"], num_kv_heads=s.hkv, num_sms=num_sms,
                           split_programs_per_sm=cfg.split_programs_per_sm, min_split_len=cfg.min_split_len)
        self.last_plan = plan
        return lambda: extend_attention(self.q, self.k, self.v, self.out, self.k_buf, self.v_buf, self.req_to_token,
                                        self.rows, self.prefix_lens, self.extend_lens, plan, cfg)

    def old_kernel(self, bm: int, bn: int, warps: int, stages: int) -> Callable[[], object]:
        import extend_attention_baseline as old

        s = self.shape
        plan = old.plan_extend_tiles([s.ext] * s.bs, [s.prefix] * s.bs, bm, ENV["device"])
        return lambda: old.extend_attention(self.q, self.k, self.v, self.out, self.k_buf, self.v_buf,
                                            self.req_to_token, self.rows, self.prefix_lens, self.extend_lens, plan,
                                            block_n=bn, num_warps=warps, num_stages=stages)

    def fa3(self) -> Optional[tuple[str, Callable[[], object]]]:
        """FlashAttention-3 from vLLM's bundle over the same pool (page size 1), if importable."""
        fn = None
        for mod in ("vllm.vllm_flash_attn", "vllm_flash_attn"):
            try:
                fn = __import__(mod, fromlist=["flash_attn_varlen_func"]).flash_attn_varlen_func
                break
            except (ImportError, AttributeError):
                continue
        if fn is None or self.kv_dtype != torch.bfloat16 or ENV["dry"]:
            return None
        s = self.shape
        dev = self.q.device
        cu_q = torch.arange(0, s.bs + 1, device=dev, dtype=torch.int32) * s.ext
        seqused = torch.full((s.bs,), s.prefix + s.ext, device=dev, dtype=torch.int32)
        table = self.req_to_token[:, :s.prefix + s.ext].to(torch.int32).contiguous()
        kc = self.k_buf.view(-1, 1, s.hkv, s.d)
        vc = self.v_buf.view(-1, 1, s.hkv, s.d)
        kwargs = dict(q=self.q, k=kc, v=vc, max_seqlen_q=s.ext, cu_seqlens_q=cu_q, max_seqlen_k=s.prefix + s.ext,
                      seqused_k=seqused, block_table=table, causal=True, out=self.out)
        for extra in (dict(fa_version=3), {}):
            try:
                fn(**kwargs, **extra)
                torch.cuda.synchronize()
                return ("fa3" if extra else "flash_attn (default version)"), \
                    (lambda extra=extra: fn(**kwargs, **extra))
            except Exception as e:  # noqa: BLE001 - a reference only: report and go on
                err = e
        print(f"#   FlashAttention importable but failed at page size 1: {type(err).__name__}: {err}"[:300])
        return None


def graph_time(fn: Callable[[], object], rep_ms: int) -> float:
    """Median ms of CUDA-graph replays of fn, the L2 flushed before each."""
    if ENV["dry"]:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = float(do_bench(graph.replay, warmup=20, rep=rep_ms, return_mode="median"))
    del graph
    return ms


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- compile children

def compile_one(job: dict) -> None:
    """In a child: compile (and run once) one variant at a small problem of the same
    specialisation as the sweep's (same heads, table width, 16-divisible token count)."""
    s = Shape("probe", job["hq"], job["hkv"], job["d"], 1, 256, 32)
    p = Problem(s, job["kv"], pool_slots=4096)
    if "old" in job:
        fn = p.old_kernel(*job["old"])
    else:
        # A forced split compiles the merge kernel too.
        fn = p.new_kernel(replace(ExtendAttentionConfig(**job["config"]), split_programs_per_sm=64,
                                  min_split_len=job["config"]["block_n"]), num_sms=132)
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def precompile(jobs: list[dict], workers: int) -> dict[str, str]:
    """job key -> error ('' when it compiled), each job in its own child process."""
    def run(job: dict) -> tuple[str, str]:
        try:
            proc = subprocess.run([sys.executable, __file__, "--compile-one", json.dumps(job)], capture_output=True,
                                  text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return job["key"], "compile timed out (300 s)"
        if proc.returncode == 0:
            return job["key"], ""
        lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
        return job["key"], (f"rc {proc.returncode}: " + (lines[-1] if lines else "no output"))[:200]

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(run, jobs))


# ----------------------------------------------------------------------------- the sweep

def config_source(cfg: ExtendAttentionConfig) -> str:
    defaults = ExtendAttentionConfig()
    extra = [f"{k}={v!r}" for k, v in asdict(cfg).items()
             if k not in ("block_m", "block_n", "num_warps", "num_stages") and v != getattr(defaults, k)]
    return (f"ExtendAttentionConfig({cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}"
            + "".join(", " + e for e in extra) + ")")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", choices=["bf16", "fp8"], default="bf16", help="the pool's dtype")
    ap.add_argument("--print-table", action="store_true", help="print the best config per head dim for TUNED")
    ap.add_argument("--rep-ms", type=int, default=60, help="do_bench rep time per measurement")
    ap.add_argument("--shapes", type=str, default="", help="comma-separated shape indices to run (default all)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4), help="parallel compile children")
    ap.add_argument("--no-precompile", action="store_true", help="compile in this process (a crash ends the sweep)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    ap.add_argument("--compile-one", type=str, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry-run needs TRITON_INTERPRET=1 in the environment (set before triton is imported)")
        ENV.update(device="cpu", dtype=torch.float16, pool_slots=4096, dry=True)
    if args.compile_one:
        job = json.loads(args.compile_one)
        if job.get("dry"):
            ENV.update(device="cpu", dtype=torch.float16, pool_slots=4096, dry=True)
        compile_one(job)
        return 0

    t_start = time.time()
    all_shapes = shapes()
    if args.shapes:
        all_shapes = [all_shapes[int(i)] for i in args.shapes.split(",")]
    num_sms = 4 if ENV["dry"] else torch.cuda.get_device_properties(0).multi_processor_count
    heads = sorted({(s.hq, s.hkv, s.d) for s in all_shapes})

    jobs = []
    for hq, hkv, d in heads:
        for cfg in variants(d):
            jobs.append(dict(key=f"{hq}/{hkv}/{d} {cfg.label()}", hq=hq, hkv=hkv, d=d, kv=args.kv, config=asdict(cfg),
                             dry=ENV["dry"]))
        for old in OLD.get(d, []):
            jobs.append(dict(key=f"{hq}/{hkv}/{d} old {old}", hq=hq, hkv=hkv, d=d, kv=args.kv, old=list(old),
                             dry=ENV["dry"]))
    failed: dict[str, str] = {}
    if not args.no_precompile:
        errors = precompile(jobs, args.workers)
        failed = {k: e for k, e in errors.items() if e}
        print(f"# compiled {len(jobs) - len(failed)}/{len(jobs)} variants in {time.time() - t_start:.0f} s "
              f"({args.workers} children)", flush=True)
        for k, e in failed.items():
            print(f"#   FAILED {k}: {e}", flush=True)

    if ENV["dry"]:
        burst = sustained = 1e12
        device_name = "CPU (Triton interpreter, dry run)"
    else:
        from radixserve.bench_one_batch import measure_matmul_rate

        burst, sustained = measure_matmul_rate(torch.device("cuda"))
        device_name = torch.cuda.get_device_name(0)
    rate = burst
    print(f"# {device_name}, {num_sms} SMs, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}; bf16 matmul {burst / 1e12:.0f} TFLOP/s burst, "
          f"{sustained / 1e12:.0f} sustained (floors use burst); pool {args.kv}", flush=True)
    print(f"{'shape':<28} {'variant':<52} {'ms':>8} {'TFLOP/s':>8} {'x floor':>8} {'err':>8}", flush=True)

    results: dict[Shape, list[tuple[float, str, Optional[ExtendAttentionConfig]]]] = {}
    for shape in all_shapes:
        prob = Problem(shape, args.kv)
        floor_ms = shape.flops() / rate * 1e3
        rows = results.setdefault(shape, [])

        def report(label: str, fn: Callable[[], object], cfg: Optional[ExtendAttentionConfig], ref) -> None:
            try:
                prob.out.fill_(float("nan"))
                fn()
                if not ENV["dry"]:
                    torch.cuda.synchronize()
                err = rel_err(prob.out, ref) if ref is not None else 0.0
                ms = graph_time(fn, args.rep_ms)
            except Exception as e:  # noqa: BLE001 - report the variant and go on
                print(f"{shape.name:<28} {label:<52} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                return
            bad = " BAD" if not err < 2e-2 else ""
            print(f"{shape.name:<28} {label:<52} {ms:8.4f} {shape.flops() / ms / 1e9:8.0f} {ms / floor_ms:8.2f} "
                  f"{err:8.1e}{bad}", flush=True)
            if not bad:
                rows.append((ms, label, cfg))

        print(f"# {shape.name}: {shape.hq} q heads / {shape.hkv} KV heads, head dim {shape.d}, "
              f"{shape.flops() / 1e9:.1f} GFLOP, floor {floor_ms:.4f} ms", flush=True)
        ref = None
        for old in OLD.get(shape.d, []):
            if f"{shape.hq}/{shape.hkv}/{shape.d} old {old}" in failed:
                continue
            fn = prob.old_kernel(*old)
            report(f"old per-head m{old[0]} n{old[1]} w{old[2]} s{old[3]}", fn, None, ref)
            if ref is None and rows:
                ref = prob.out.clone()
        fa = prob.fa3()
        if fa is not None:
            report(fa[0], fa[1], None, ref)
        splits = SPLITS if shape.prefix else (TUNED.get(shape.d, ExtendAttentionConfig()).split_programs_per_sm,)
        for cfg in variants(shape.d):
            if f"{shape.hq}/{shape.hkv}/{shape.d} {cfg.label()}" in failed:
                continue
            for split in splits:
                c = replace(cfg, split_programs_per_sm=split)
                fn = prob.new_kernel(c, num_sms)
                parts = f" ({prob.last_plan.num_items} items)" if split else ""
                report(c.label() + parts, fn, c, ref)
                if ref is None and rows:
                    ref = prob.out.clone()
        rows.sort(key=lambda r: r[0])
        best = ", ".join(f"{label} {ms:.4f}" for ms, label, _ in rows[:3])
        print(f"# best {shape.name}: {best}", flush=True)
        del prob
        if not ENV["dry"]:
            torch.cuda.empty_cache()

    if args.print_table:
        print_table(results, rate)
    print(f"# total {time.time() - t_start:.0f} s", flush=True)
    return 0


def print_table(results, rate: float) -> None:
    """Per head dim: the config whose worst slowdown against each shape's best (of the new
    kernel's variants) is smallest, in the form TUNED takes."""
    by_dim: dict[int, list[Shape]] = {}
    for shape in results:
        by_dim.setdefault(shape.d, []).append(shape)
    print("# best config per head dim (smallest worst-case slowdown against each shape's best):", flush=True)
    print("TUNED: dict[int, ExtendAttentionConfig] = {", flush=True)
    for d, dim_shapes in sorted(by_dim.items()):
        times: dict[ExtendAttentionConfig, dict[Shape, float]] = {}
        best = {}
        for shape in dim_shapes:
            new = [(ms, cfg) for ms, _, cfg in results[shape] if cfg is not None]
            if not new:
                continue
            best[shape] = min(ms for ms, _ in new)
            for ms, cfg in new:
                # A shape without a prefix never splits: its time serves every split setting.
                keys = [replace(cfg, split_programs_per_sm=s) for s in SPLITS] if not shape.prefix else [cfg]
                for key in keys:
                    times.setdefault(key, {})[shape] = ms
        complete = {c: t for c, t in times.items() if set(t) == set(best)}
        if not complete:
            continue
        cfg, t = min(complete.items(), key=lambda kv: max(kv[1][s] / best[s] for s in best))
        note = " | ".join(f"{s.bs}x({s.prefix}+{s.ext}) {t[s]:.3f} ms {t[s] / (s.flops() / rate * 1e3):.2f}x"
                          for s in best)
        print(f"    {d}: {config_source(cfg)},  # {note}", flush=True)
    print("}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
