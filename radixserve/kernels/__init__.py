"""Fused Triton kernels for the model's element-wise work (CUDA only).

- `radixserve.kernels.norm`: `rms_norm(x, weight, eps)`, `add_rms_norm(x, residual, weight, eps)`
- `radixserve.kernels.activation`: `silu_and_mul(gate_up)`
- `radixserve.kernels.rope`: `apply_rope_(q, k, positions, cos, sin)`

Each submodule imports triton at its top; this package imports nothing, so it is safe to import
on any machine.
"""
