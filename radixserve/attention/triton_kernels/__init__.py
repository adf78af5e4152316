"""Triton kernels of the attention backend: KV store, decode (split-K) and extend attention.

Each submodule imports triton at its top, so import them only where triton exists (on CUDA);
this package itself imports nothing.
"""
