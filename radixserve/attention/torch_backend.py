"""The reference attention backend: plain torch, runs wherever torch runs.

K/V of the new tokens are written to the pool first and every request then reads its whole
context back through req_to_token, so the prefix path, the chunked path and decode all see the
same cached values (an FP8 pool's values multiplied by its per-layer scales). GQA is computed by
folding the query heads of one KV head into the query length ([Hkv, G*E, D] against [Hkv, S, D])
instead of copying K/V G times.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.cache.kv_pool import KVPool, fp8_dequantize, gather_fp8

# Decode requests are attended in groups whose padded K/V gather stays below this many tokens,
# bounding the temporary memory of the batched path.
_DECODE_GROUP_TOKENS = 1 << 20

# cuDNN attention builds an execution plan for every new KV length it sees (~0.5 s each on an
# H200); a serving loop sees a new length every step, so only the plan-free kernels are allowed.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _ExtendSeq:
    q_start: int
    q_end: int
    kv_slots: torch.Tensor  # [S] slots of positions 0..seq_len-1
    mask: Optional[torch.Tensor]  # [E, S] bool, True = may attend; None when E == 1 (sees all S)


@dataclass
class _DecodeGroup:
    q_start: int
    q_end: int
    kv_slots: torch.Tensor  # [B, Smax], padded with slot 0
    valid: torch.Tensor  # [B, 1, 1, Smax] bool


@dataclass
class TorchAttentionMeta:
    extend_seqs: list[_ExtendSeq]
    decode_groups: list[_DecodeGroup]


class TorchAttentionBackend:
    def init_forward(self, batch: ForwardBatch) -> None:
        # Slot lists and masks depend only on the batch, so they are built once, not per layer.
        device = batch.req_to_token.device
        rows = batch.req_pool_indices.tolist()
        one_token_each = batch.mode is ForwardMode.DECODE or all(e == 1 for e in batch.extend_lens_cpu)
        meta = TorchAttentionMeta([], [])
        if one_token_each:
            start = 0
            while start < len(rows):
                end, s_max = start + 1, batch.seq_lens_cpu[start]
                while end < len(rows):
                    grown = max(s_max, batch.seq_lens_cpu[end])
                    if (end - start + 1) * grown > _DECODE_GROUP_TOKENS:
                        break
                    s_max, end = grown, end + 1
                idx = batch.req_pool_indices[start:end].to(device)
                lens = batch.seq_lens[start:end].to(device)
                slots = batch.req_to_token[idx, :s_max]
                valid = torch.arange(s_max, device=device)[None, :] < lens[:, None]
                # Padding points at slot 0 (reserved, always finite) so masked values stay harmless.
                slots = torch.where(valid, slots, torch.zeros_like(slots))
                meta.decode_groups.append(_DecodeGroup(start, end, slots, valid[:, None, None, :]))
                start = end
        else:
            q_start = 0
            for i, row in enumerate(rows):
                seq_len, ext = batch.seq_lens_cpu[i], batch.extend_lens_cpu[i]
                prefix = batch.prefix_lens_cpu[i]
                assert prefix + ext == seq_len, f"request {i}: prefix {prefix} + extend {ext} != seq_len {seq_len}"
                slots = batch.req_to_token[row, :seq_len]
                mask = None
                if ext > 1:
                    # New token j sits at position prefix + j and sees keys 0..prefix + j.
                    q_pos = torch.arange(prefix, seq_len, device=device)
                    mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
                meta.extend_seqs.append(_ExtendSeq(q_start, q_start + ext, slots, mask))
                q_start += ext
        batch.attn_meta = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, *, save_kv: bool = True) -> torch.Tensor:
        if save_kv:
            batch.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        meta = batch.attn_meta
        assert isinstance(meta, TorchAttentionMeta), "init_forward must run before forward"
        t, hq, d = q.shape
        scale = 1.0 / math.sqrt(d)
        # CPU kernels may keep low-precision softmax in low precision; the reference computes in fp32.
        compute_dtype = torch.float32 if q.device.type == "cpu" else q.dtype
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        kernels = sdpa_kernel(_CUDA_SDPA_BACKENDS) if q.device.type == "cuda" else contextlib.nullcontext()
        with kernels:
            self._attend(q, _PoolLayer(batch.kv_pool, layer_id, compute_dtype), out, meta, compute_dtype, scale)
        return out.view(t, hq * d)

    @staticmethod
    def _attend(q: torch.Tensor, kv: "_PoolLayer", out: torch.Tensor, meta: TorchAttentionMeta,
                compute_dtype: torch.dtype, scale: float) -> None:
        hq, d = q.shape[1], q.shape[2]
        hkv = kv.num_kv_heads
        group = hq // hkv
        for g in meta.decode_groups:
            b = g.q_end - g.q_start
            qg = q[g.q_start:g.q_end].view(b, hkv, group, d).to(compute_dtype)
            kg = kv.keys(g.kv_slots).transpose(1, 2)  # [B, Hkv, Smax, D]
            vg = kv.values(g.kv_slots).transpose(1, 2)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.valid, scale=scale)
            out[g.q_start:g.q_end] = og.reshape(b, hq, d).to(q.dtype)

        for s in meta.extend_seqs:
            e = s.q_end - s.q_start
            # [E, Hkv, G, D] -> [Hkv, G*E, D]: all queries that share a KV head attend together.
            qs = q[s.q_start:s.q_end].view(e, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * e, d)
            ks = kv.keys(s.kv_slots).transpose(0, 1)  # [Hkv, S, D]
            vs = kv.values(s.kv_slots).transpose(0, 1)
            mask = None if s.mask is None else s.mask.repeat(group, 1)  # row g*E + j -> mask[j]
            os_ = F.scaled_dot_product_attention(qs.to(compute_dtype), ks, vs, attn_mask=mask, scale=scale)
            out[s.q_start:s.q_end] = os_.view(hkv, group, e, d).permute(2, 0, 1, 3).reshape(e, hq, d).to(q.dtype)


class _PoolLayer:
    """One layer's K/V as the pool's slots stand for them, in the compute dtype (an FP8 pool's
    values times its scales)."""

    def __init__(self, pool: KVPool, layer_id: int, dtype: torch.dtype):
        self.k_buf = pool.k_buffers[layer_id]
        self.v_buf = pool.v_buffers[layer_id]
        self.num_kv_heads = self.k_buf.shape[1]
        self.dtype = dtype
        self.scales = (pool.k_scales[layer_id], pool.v_scales[layer_id]) if pool.is_fp8 else None

    def keys(self, slots: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return self.k_buf[slots].to(self.dtype)
        return fp8_dequantize(gather_fp8(self.k_buf, slots), self.scales[0], self.dtype)

    def values(self, slots: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return self.v_buf[slots].to(self.dtype)
        return fp8_dequantize(gather_fp8(self.v_buf, slots), self.scales[1], self.dtype)
