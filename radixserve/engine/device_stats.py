"""Process-wide device counters that explain a slow step (CUDA only): how many variants each
Triton kernel has compiled, and how often the CUDA caching allocator had to free its cache and
retry. Either stalls every running request; the serving loop reads them after a slow step."""

from __future__ import annotations


def compiled_kernel_variants() -> dict[str, int]:
    """Kernel name -> compiled variants in this process (imports triton)."""
    from radixserve.kernels import compiled_variant_counts

    return compiled_variant_counts()


def cuda_alloc_retries() -> int:
    """cudaMalloc failures the allocator recovered from by emptying its cache and synchronizing."""
    import torch

    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
