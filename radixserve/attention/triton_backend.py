"""The Triton attention backend (CUDA): KV store, split-K decode and ragged extend kernels.

Triton is imported when the backend is constructed, never when this module is imported, so
the package imports on machines without triton.

Per forward pass, `init_forward` (and, for what needs the number of query heads, the first
layer) prepares everything the layers share (decode: the number of splits and views of a float32
workspace; extend: the kernel's config for the head shape, and the work list (tiles of packed
query-head groups, long prefixes split when the batch is small), copied to the device once, with
the split results' float32 workspace). Each layer's
`forward` then launches the KV store (unless the caller stored k and v already: save_kv=False)
and the attention kernels with no host sync and no allocation beyond its output.

CUDA graphs (decode): the launches depend only on the batch size, the head shape and the
number of splits, which is a function of the batch size alone; seq_lens, req_pool_indices,
out_cache_loc and req_to_token are read from device memory. A runner that captures graphs
must (1) call `reserve_decode_workspace(max_batch_size, num_q_heads, num_kv_heads, head_dim,
device)` before capturing, so no workspace is allocated inside a capture, and (2) hand the captured
ForwardBatch's tensors (seq_lens, req_pool_indices, out_cache_loc, positions, input_ids) as
static buffers whose contents it rewrites before each replay. Padded rows may have any
seq_len >= 0 (0 gives a zero output) and must point out_cache_loc at a harmless slot (0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.cache.kv_pool import fp8_dequantize, fp8_quantize


@dataclass
class TritonDecodeMeta:
    num_splits: int
    mid_o: Optional[torch.Tensor]  # [B, Hq, num_splits, D] float32, set by the first layer
    mid_lse: Optional[torch.Tensor]  # [B, Hq, num_splits] float32


@dataclass
class TritonExtendMeta:
    extend_lens: list[int]
    prefix_lens: list[int]
    # The leading requests that add one token each (the decoding requests of a mixed step) go
    # through the decode kernel, which reads each KV head once for its whole query-head group;
    # the extend kernel would read it once per query head, with 1 useful row in each tile.
    num_decode: int = 0
    decode: Optional[TritonDecodeMeta] = None
    # Made by the first layer, which knows the number of query heads.
    config: Optional[object] = None  # extend_attention_config.ExtendAttentionConfig
    plan: Optional[object] = None  # extend_attention_plan.ExtendPlan


class TritonAttentionBackend:
    """Attention for Qwen2-style GQA on CUDA. Optional tuning knobs; the defaults suit an H200.

    decode_block_n / decode_num_warps / decode_num_stages: stage-1 tile of positions and launch
    shape; max_splits caps split-K; decode_programs_per_sm: how many stage-1 programs per streaming
    multiprocessor the split count aims for when the batch alone gives fewer programs than there are
    multiprocessors (a batch that fills one wave is not split: the merge launch and the workspace
    round trip cost more than the last wave's imbalance). Defaults from sweeps on an H200
    (docs/runs/2026-11-30-triton-kernels-and-fused-model.md). extend_config: one ExtendAttentionConfig
    for every head shape instead of the per-head-dim table (radixserve.kernels.extend_attention_config;
    sweeps set it).

    Heads wider than 128 (the hybrid Qwen models' 256) hold twice the bytes per tile row: the
    decode tiles are cut to fit shared memory (`wide_head_decode_tiles`: BLOCK_N 64 over 2 stages).
    """

    def __init__(self, *, decode_block_n: int = 128, decode_num_warps: int = 4, decode_num_stages: int = 3,
                 max_splits: int = 64, decode_programs_per_sm: int = 2, extend_config=None,
                 num_sms: Optional[int] = None):
        # Imported here so that merely importing this module needs no triton.
        from radixserve.kernels import decode_attention, extend_attention, extend_attention_config, \
            extend_attention_plan, kv_store

        self._decode = decode_attention
        self._extend = extend_attention
        self._extend_config = extend_attention_config
        self._extend_plan = extend_attention_plan
        self._kv_store = kv_store
        self.decode_block_n = decode_block_n
        self.decode_num_warps = decode_num_warps
        self.decode_num_stages = decode_num_stages
        self.max_splits = max_splits
        self.decode_programs_per_sm = decode_programs_per_sm
        self.extend_config = extend_config
        self._num_sms = num_sms
        self._ws_o: Optional[torch.Tensor] = None
        self._ws_lse: Optional[torch.Tensor] = None
        self._retired: list[Optional[torch.Tensor]] = []

    # ------------------------------------------------------------------ decode workspace

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms

    def num_splits(self, batch_size: int, num_kv_heads: int, device: torch.device) -> int:
        """Splits per (request, KV head): enough programs to fill the GPU, a function of B only."""
        groups = max(1, batch_size * num_kv_heads)
        sms = self.num_sms(device)
        if groups >= sms:
            return 1
        return max(1, min(self.max_splits, math.ceil(self.decode_programs_per_sm * sms / groups)))

    def reserve_decode_workspace(self, max_batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                                 device: torch.device | str) -> None:
        """Allocate the split-K workspace for every batch size up to max_batch_size (before graph capture)."""
        device = torch.device(device)
        need_o = need_lse = 0
        for bs in range(1, max_batch_size + 1):
            o, lse = self._decode.workspace_numel(bs, num_q_heads, self.num_splits(bs, num_kv_heads, device), head_dim)
            need_o, need_lse = max(need_o, o), max(need_lse, lse)
        self._ensure_workspace(need_o, need_lse, device)

    def _ensure_workspace(self, numel_o: int, numel_lse: int, device: torch.device) -> None:
        # A replaced workspace is kept alive: captured CUDA graphs still write to it, and freed
        # memory could be handed to other tensors.
        if self._ws_o is None or self._ws_o.numel() < numel_o or self._ws_o.device != device:
            self._retired.append(self._ws_o)
            self._ws_o = torch.empty(numel_o, dtype=torch.float32, device=device)
        if self._ws_lse is None or self._ws_lse.numel() < numel_lse or self._ws_lse.device != device:
            self._retired.append(self._ws_lse)
            self._ws_lse = torch.empty(numel_lse, dtype=torch.float32, device=device)

    # ------------------------------------------------------------------ the protocol

    def init_forward(self, batch: ForwardBatch) -> None:
        one_token_each = batch.mode is ForwardMode.DECODE or all(e == 1 for e in batch.extend_lens_cpu)
        k_buf = batch.kv_pool.k_buffers[0]
        device = k_buf.device
        if one_token_each:
            bs = int(batch.req_pool_indices.shape[0])
            # The number of query heads is first seen by forward: the first layer makes the
            # workspace views (no allocation once reserve_decode_workspace ran).
            batch.attn_meta = TritonDecodeMeta(self.num_splits(bs, k_buf.shape[1], device), None, None)
        else:
            ext = list(batch.extend_lens_cpu)
            num_decode = 0
            while ext[num_decode] == 1:  # stops: not every request adds one token
                num_decode += 1
            decode = TritonDecodeMeta(self.num_splits(num_decode, k_buf.shape[1], device), None, None) \
                if num_decode else None
            batch.attn_meta = TritonExtendMeta(ext, list(batch.prefix_lens_cpu), num_decode, decode)

    def extend_attention_config(self, head_dim: int, dtype: torch.dtype):
        """The extend kernel's config for this head dimension and dot dtype (the table's, unless
        the backend was given one)."""
        if self.extend_config is not None:
            return self.extend_config
        return self._extend_config.config_for(head_dim, dtype)

    def plan_extend(self, meta: TritonExtendMeta, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device: torch.device) -> None:
        """The config and the work list of one extend pass (the first layer makes them)."""
        cfg = self.extend_attention_config(head_dim, dtype)
        meta.config = cfg
        meta.plan = self._extend_plan.plan_extend(
            meta.extend_lens, meta.prefix_lens, group=num_q_heads // num_kv_heads, block_m=cfg.block_m,
            block_n=cfg.block_n, device=device, num_kv_heads=num_kv_heads, num_sms=self.num_sms(device),
            split_programs_per_sm=cfg.split_programs_per_sm, min_split_len=cfg.min_split_len,
            first_request=meta.num_decode)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, *, save_kv: bool = True) -> torch.Tensor:
        pool = batch.kv_pool
        k_buf = pool.k_buffers[layer_id]
        v_buf = pool.v_buffers[layer_id]
        fp8 = pool.is_fp8
        scales = (pool.k_scales[layer_id], pool.v_scales[layer_id]) if fp8 else (1.0, 1.0)
        if save_kv:
            self._kv_store.store_kv(k, v, k_buf, v_buf, batch.out_cache_loc, *scales)
        meta = batch.attn_meta
        num_tokens, num_q_heads, head_dim = q.shape
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
        if q.dtype != k_buf.dtype and not fp8:
            # The dots take operands of one dtype: the pool's (an FP8 pool's tiles are widened to
            # q's in the kernels). The output keeps q's.
            q = q.to(k_buf.dtype)
        if q.stride(2) != 1:
            q = q.contiguous()

        if isinstance(meta, TritonDecodeMeta):
            self._decode_attention(meta, q, k_buf, v_buf, batch, out, num_tokens, scales)
        elif isinstance(meta, TritonExtendMeta):
            if meta.num_decode:
                d = meta.num_decode
                self._decode_attention(meta.decode, q[:d], k_buf, v_buf, batch, out[:d], d, scales)
            if fp8:
                # Phase 2 reads the new k/v directly: give it the values the pool holds.
                k = fp8_dequantize(fp8_quantize(k, scales[0]), scales[0], q.dtype)
                v = fp8_dequantize(fp8_quantize(v, scales[1]), scales[1], q.dtype)
            elif k_buf.dtype != k.dtype:
                k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)
            if k.stride(2) != 1 or v.stride(2) != 1:
                k, v = k.contiguous(), v.contiguous()
            if meta.plan is None:
                self.plan_extend(meta, num_q_heads, k_buf.shape[1], head_dim, q.dtype, q.device)
            self._extend.extend_attention(
                q, k, v, out, k_buf, v_buf, batch.req_to_token, batch.req_pool_indices,
                batch.prefix_lens, batch.extend_lens, meta.plan, meta.config, k_scale=scales[0], v_scale=scales[1])
        else:
            raise RuntimeError("init_forward must run before forward")
        return out.view(num_tokens, num_q_heads * head_dim)

    def _decode_attention(self, meta: TritonDecodeMeta, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                          batch: ForwardBatch, out: torch.Tensor, bs: int, scales: tuple[float, float]) -> None:
        """One token for each of the first bs requests of the batch."""
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        if meta.mid_o is None:
            numel_o, numel_lse = self._decode.workspace_numel(bs, num_q_heads, meta.num_splits, head_dim)
            self._ensure_workspace(numel_o, numel_lse, q.device)
            meta.mid_o = self._ws_o[:numel_o].view(bs, num_q_heads, meta.num_splits, head_dim)
            meta.mid_lse = self._ws_lse[:numel_lse].view(bs, num_q_heads, meta.num_splits)
        block_n, stages = (self.decode_block_n, self.decode_num_stages) if head_dim <= 128 else \
            wide_head_decode_tiles(self, q.dtype)
        self._decode.decode_attention(
            q, k_buf, v_buf, batch.req_to_token, batch.req_pool_indices[:bs], batch.seq_lens[:bs], out,
            meta.mid_o, meta.mid_lse, meta.num_splits, block_n=block_n,
            num_warps=self.decode_num_warps, num_stages=stages, k_scale=scales[0],
            v_scale=scales[1])


def wide_head_decode_tiles(backend: TritonAttentionBackend, dtype: torch.dtype) -> tuple[int, int]:
    """(decode BLOCK_N, stages) for heads wider than 128: half the positions per tile and two
    stages, so k and v tiles of 256 values a row fit an H200's shared memory (float32: halved
    again)."""
    narrow = 2 if dtype == torch.float32 else 1
    return min(backend.decode_block_n, 64 // narrow), min(backend.decode_num_stages, 2)
