"""Every Triton kernel of the package (CUDA; the CPU runs them only under TRITON_INTERPRET=1).

- `radixserve.kernels.norm`: `rms_norm(x, weight, eps)`, `add_rms_norm(x, residual, weight, eps)`,
  and `rms_norm_fp8(x, weight, eps, residual)`, either one writing e4m3 rows with per-token scales
  for an FP8 projection
- `radixserve.kernels.quant_fp8`: `quantize_rows_fp8(x)`, activations to e4m3 with per-token scales
- `radixserve.kernels.activation`: `silu_and_mul(gate_up)`
- `radixserve.kernels.decode_linear`: `decode_linear(x, weight, bias, config)`, the GEMM of a decode
  batch's few rows (weights streamed by many programs; K split with a deterministic reduce)
- `radixserve.kernels.decode_linear_fp8`: `decode_linear_fp8(x, weight, weight_scale, bias, config)`, the
  same over e4m3 weights with per-output-channel scales (FP8 projections)
- `radixserve.kernels.rope`: `apply_rope_(q, k, positions, cos, sin, *, v, k_buf, v_buf, loc)` (RoPE, and
  optionally Qwen3's per-head q/k RMSNorm before it and the KV store after it, in one launch)
- `radixserve.kernels.kv_store`: `store_kv(k, v, k_buf, v_buf, loc)`, the KV store alone
- `radixserve.kernels.decode_attention`, `radixserve.kernels.extend_attention`: the attention
  kernels behind `radixserve.attention.triton_backend` (split-K decode; ragged extend with each KV
  head's query group packed into one row block and long prefixes split over programs), with the
  extend kernel's host side in `extend_attention_plan` (its work list) and `extend_attention_config`
  (its tiles per head dim)
- `radixserve.kernels.token_bitmask`: `apply_token_bitmask_rows_(logits, bitmask, rows)`, grammar
  masking of the constrained rows from xgrammar's packed bitmask, in place
- `radixserve.kernels.launch`: `FastKernel`, which launches a compiled kernel through its C launcher
  after the first call of each specialisation (every kernel here goes through it)

The KV store, the fused RoPE store and both attention kernels take an FP8 (e4m3) pool too: it
holds K / k_scale and V / v_scale, and the readers multiply the scales back in.

The kernels read and write plain tensors (the KV pool's buffers among them) and import nothing
from the layers above (attention, model). The kernel submodules import triton at their top
(launch.py only when a FastKernel is made); this package imports nothing, so it is safe to import
on any machine.
"""


def compiled_variant_counts() -> dict[str, int]:
    """How many compiled variants each of our Triton kernels holds in this process (CUDA only:
    imports triton). A count that grows while serving means a compile stalled the engine."""
    from radixserve.kernels import (activation, decode_attention, decode_linear, decode_linear_fp8, extend_attention,
                                    kv_store, norm, rope, token_bitmask)

    kernels = {"decode_stage1": decode_attention._decode_stage1_kernel,
               "decode_stage2": decode_attention._decode_stage2_kernel,
               "extend": extend_attention._extend_kernel, "extend_merge": extend_attention._merge_kernel,
               "store_kv": kv_store._store_kv_kernel,
               "rope": rope._rope_kernel, "rms_norm": norm._rms_norm_kernel,
               "silu_and_mul": activation._silu_and_mul_kernel,
               "decode_linear": decode_linear._decode_linear_kernel,
               "decode_linear_fp8": decode_linear_fp8._decode_linear_fp8_kernel,
               "decode_linear_reduce": decode_linear._reduce_partials_kernel,
               "token_bitmask": token_bitmask._apply_token_bitmask_kernel}
    counts = {}
    for name, fn in kernels.items():
        caches = getattr(fn, "device_caches", None)  # triton >= 3.2: {device: (kernel cache, ...)}
        counts[name] = sum(len(entry[0]) for entry in caches.values()) if caches is not None \
            else sum(len(c) for c in fn.cache.values())
    return counts
