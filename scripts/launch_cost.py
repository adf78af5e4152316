"""Host time per kernel launch on a CUDA machine: what an eager (non-graph) step pays per kernel.

    . scripts/gpu_run.sh && python3 scripts/launch_cost.py

Times N back-to-back launches of each of our Triton kernels (through their wrappers, which
launch through radixserve.kernels.launch.FastKernel) and of comparable torch ops on small
inputs, without synchronising in between (the GPU work is tiny, so the host is the
bottleneck), and prints microseconds per launch; then rms_norm through Triton's own dispatch
and through its compiled kernel's C launcher alone. An eager prefill or mixed step of Qwen2-0.5B
makes ~250 launches, so every 10 us here is ~2.5 ms of its time.
"""

from __future__ import annotations

import time

import torch

from radixserve.kernels import decode_linear
from radixserve.kernels.decode_linear_config import config_for
from radixserve.kernels.activation import silu_and_mul
from radixserve.kernels.norm import add_rms_norm, rms_norm
from radixserve.kernels.rope import apply_rope_
from radixserve.model.layers import rope_cos_sin


def per_launch_us(fn, n: int = 2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / n * 1e6


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    t, hidden, hq, hkv, d = 16, 896, 14, 2, 64
    x = torch.randn(t, hidden, device=dev, dtype=dt)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=dev, dtype=dt)
    gate_up = torch.randn(t, 2 * 4864, device=dev, dtype=dt)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    cos, sin = (c.to(dt) for c in rope_cos_sin(4096, d, 1e6, dev))
    pos = torch.arange(t, device=dev)
    k_buf = torch.zeros(1024, hkv, d, device=dev, dtype=dt)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.arange(1, t + 1, device=dev)
    weight = torch.randn(1152, hidden, device=dev, dtype=dt)
    bias = torch.randn(1152, device=dev, dtype=dt)
    w_down = torch.randn(hidden, 4864, device=dev, dtype=dt)
    h = torch.randn(t, 4864, device=dev, dtype=dt)
    w_gate_up = torch.randn(2 * 4864, hidden, device=dev, dtype=dt)
    qkv_cfg, down_cfg, gate_up_cfg = (config_for(w_) for w_ in (weight, w_down, w_gate_up))
    rows = {
        "triton rms_norm": lambda: rms_norm(x, w, 1e-6),
        "triton add_rms_norm": lambda: add_rms_norm(x, res, w, 1e-6),
        "triton silu_and_mul": lambda: silu_and_mul(gate_up),
        "triton rope + kv store": lambda: apply_rope_(q, k, pos, cos, sin, v=v, k_buf=k_buf, v_buf=v_buf, loc=loc),
        "triton decode_linear (qkv)": lambda: decode_linear.decode_linear(x, weight, bias, qkv_cfg),
        f"triton decode_linear (down, split {down_cfg.split})": lambda: decode_linear.decode_linear(
            h, w_down, None, down_cfg),
        "triton decode_linear (gate_up, silu)": lambda: decode_linear.decode_linear(
            x, w_gate_up, None, gate_up_cfg, silu_mul=True),
        "torch add": lambda: torch.add(x, res),
        "torch linear (bias)": lambda: torch.nn.functional.linear(x, weight, bias),
        "torch empty": lambda: torch.empty((t, hq, d), device=dev, dtype=dt),
    }
    # Where rms_norm's time goes: our wrapper (checks, the output allocation), Triton's dispatch
    # (binding and specialising every argument, the cache lookup), and the launch itself (the
    # compiled kernel's C launcher, given arguments already bound).
    from radixserve.kernels import norm

    y = torch.empty_like(x)
    args = (x, x, w, y, x, w, x.stride(0), x.stride(0), y.stride(0), x.stride(0), hidden, 1e-6)
    consts = dict(HAS_RESIDUAL=False, FP8_OUT=False, BLOCK=1024, num_warps=2)
    rows["triton rms_norm: dispatch"] = lambda: norm._rms_norm_kernel[(t,)](*args, **consts)
    try:
        from triton import knobs
        from triton.runtime import driver

        kernel = norm._rms_norm_kernel[(t,)](*args, **consts)
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        bound = list(args) + [False, False, 1024]
        meta = kernel.launch_metadata((t,), stream, *bound)
        rows["triton rms_norm: C launch"] = lambda: kernel.run(
            t, 1, 1, stream, kernel.function, kernel.packed_metadata, meta, knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook, *bound)
    except Exception as e:  # another Triton's internals
        print(f"# the direct launch is not available here: {e!r}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, fn in rows.items():
        print(f"{name:<30} {per_launch_us(fn):7.1f} us per launch (host)")
    # Where decode_linear's host time goes (it launches through FastKernel like the others).
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(lambda: [decode_linear.decode_linear(x, weight, bias, qkv_cfg) for _ in range(2000)])
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    if "triton rms_norm: C launch" in rows:
        y.zero_()
        rows["triton rms_norm: C launch"]()
        torch.cuda.synchronize()
        print(f"# the direct launch wrote rms_norm's output: {torch.equal(y, rms_norm(x, w, 1e-6))}")


if __name__ == "__main__":
    main()
