"""Chunked Gated DeltaNet prefill through flash-linear-attention (`fla-core`, pure Triton), when it
is installed: the chunk-parallel form of the delta rule, which runs a long prompt in parallel
where radixserve.kernels.gated_delta's recurrent kernel walks it token by token.

Optional: `pip install fla-core` (it brings only einops; torch and triton are ours). Nothing
imports it until a CUDA prefill asks `available()`; without it (or on the CPU) the layer takes
the recurrent kernel or the torch reference. fla computes the state in float32 and takes and
returns it as [sequences, v_heads, k_head_dim, v_head_dim], our pool's layout, so a prefill
gathers its continued sequences' states, runs, and scatters the final states back.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("radixserve")


@functools.lru_cache(maxsize=1)
def _chunk_fn():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001: any failure to import means: not available here
        logger.info("flash-linear-attention is not available (%s): Gated DeltaNet prefill runs the "
                    "recurrent Triton kernel", type(e).__name__)
        return None
    return chunk_gated_delta_rule


def available() -> bool:
    """Whether fla's chunked kernel can run here (CUDA and fla-core importable)."""
    return torch.cuda.is_available() and _chunk_fn() is not None


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged batch: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, float32) and beta [T, Hv],
    initial_state [N, Hv, Dk, Dv] float32 (zeros for new sequences), cu_seqlens [N + 1] int64.
    q and k are L2-normalised inside, q scaled by Dk^-1/2. Returns (o [T, Hv, Dv] in v's dtype,
    final states [N, Hv, Dk, Dv] float32)."""
    fn = _chunk_fn()
    if fn is None:
        raise RuntimeError("flash-linear-attention (fla-core) is not installed")
    o, final = fn(q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g.contiguous()[None],
                  beta.contiguous()[None], initial_state=initial_state, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return o[0], final
