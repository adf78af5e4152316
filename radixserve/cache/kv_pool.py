"""KV memory: per-layer K/V buffers of token slots, a page allocator and the req_to_token table.

Slots are grouped in pages of `page_size` tokens; page 0 is never handed out, so padded rows of
a batch (CUDA-graph buckets) can write there harmlessly. A token at position i of a request lives
at `req_to_token[req_index, i]`; with pages, the slots of positions in one page are consecutive.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from radixserve.cache.state_pool import RecurrentStatePool

if TYPE_CHECKING:
    from radixserve.cache.state_snapshots import StateSnapshots


class PageAllocator:
    """Free list of KV pages. Sizes are counted in tokens (pages x page_size)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError("the KV pool holds no page")
        self.page_size = page_size
        self.num_pages = num_pages
        # Pages 1..num_pages; popping from the end hands out low pages first.
        # Machine integers, not a list of Python ints: the invariant check reads the whole free
        # list as a tensor without converting millions of objects.
        self._free_pages = array("q", range(num_pages, 0, -1))

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def alloc_pages(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free_pages):
            return None
        if n == 0:
            return []
        taken = self._free_pages[-n:].tolist()
        del self._free_pages[-n:]
        return taken

    def free_pages(self, pages: list[int]) -> None:
        self._free_pages.extend(pages)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free whole pages given as their token slots (length a multiple of page_size)."""
        if slots.numel() == 0:
            return
        assert slots.numel() % self.page_size == 0, "slots must cover whole pages"
        self._free_pages.extend((slots[:: self.page_size] // self.page_size).tolist())

    def free_slot_tensor(self) -> torch.Tensor:
        """Every free slot, as a new int64 tensor."""
        return self._expand_pages(int64_tensor(self._free_pages))  # a copy: the free list changes

    def pages_to_slots(self, pages: list[int]) -> torch.Tensor:
        return self._expand_pages(int64_tensor(pages))

    def _expand_pages(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)


FP8_KV_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0


class KVPool:
    """K and V buffers per layer, indexed by token slot: [num_slots, num_kv_heads, head_dim].

    An FP8 pool (dtype float8_e4m3fn) holds K / k_scales[layer] and V / v_scales[layer], saturated
    at +-448: one byte per value, so the same memory holds twice the tokens of a bf16 pool;
    readers multiply the scales back in. Other dtypes ignore the scales.

    `num_layers` counts the layers that keep KV (a hybrid model's full-attention layers only).
    `state`: a hybrid model's per-request recurrent states (radixserve.cache.state_pool), which
    every forward pass reaches through the pool it is given; None for attention-only models.
    `snapshots`: the prefix cache's snapshots of those states (radixserve.cache.state_snapshots;
    None without them), built beside them by the engine and read by no forward pass.
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str,
                 kv_scales: Optional[Sequence[tuple[float, float]]] = None,
                 state: Optional[RecurrentStatePool] = None, snapshots: Optional["StateSnapshots"] = None):
        num_pages = num_tokens // page_size
        self.allocator = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.num_slots = (num_pages + 1) * page_size  # + the reserved page 0
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        scales = list(kv_scales) if kv_scales is not None else [(1.0, 1.0)] * num_layers
        if len(scales) != num_layers:
            raise ValueError(f"{len(scales)} KV scale pairs for {num_layers} layers")
        self.k_scales = [float(k) for k, _ in scales]
        self.v_scales = [float(v) for _, v in scales]
        self.state = state
        self.snapshots = snapshots

    @property
    def is_fp8(self) -> bool:
        return self.k_buffers[0].dtype == FP8_KV_DTYPE if self.k_buffers else False

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.is_fp8:
            # Scattered as bytes: indexing kernels for float8 are missing from some torch builds.
            k_bytes = fp8_quantize(k, self.k_scales[layer_id]).view(torch.uint8)
            v_bytes = fp8_quantize(v, self.v_scales[layer_id]).view(torch.uint8)
            self.k_buffers[layer_id].view(torch.uint8)[slots] = k_bytes
            self.v_buffers[layer_id].view(torch.uint8)[slots] = v_bytes
            return
        self.k_buffers[layer_id][slots] = k.to(self.k_buffers[layer_id].dtype)
        self.v_buffers[layer_id][slots] = v.to(self.v_buffers[layer_id].dtype)


def fp8_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 of x / scale, saturated at +-448 (what an FP8 pool stores)."""
    return (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_KV_DTYPE)


def gather_fp8(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots] of an FP8 buffer, gathered as bytes (see KVPool.store)."""
    return buf.view(torch.uint8)[slots].view(FP8_KV_DTYPE)


def fp8_dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What an FP8 pool's values stand for, in `dtype`: x * scale."""
    return (x.float() * scale).to(dtype)


class ReqToTokenPool:
    """Rows of slot indices, one row per running request, `max_context` positions each."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str):
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64, device=device)
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, writes: "TableWrites") -> None:
        """Apply the collected writes (table[row, col] = slot) as one device operation."""
        self.write_tensors(*writes.tensors())

    def write_tensors(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i] for all i (host int64 tensors), as one device operation."""
        device = self.table.device
        self.table.index_put_((rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)),
                              slots.to(device, non_blocking=True))


class TableWrites:
    """Writes to a `ReqToTokenPool` table collected while a step is scheduled, applied as one device
    operation. Single positions (each decoding request's next slot) go into flat lists; a run of
    consecutive positions (a prompt's slots) stays whole until `tensors()`, so admitting a
    2,000-token prompt costs one conversion of its slots instead of three 2,000-element list
    extensions (with 50 such prompts a step, that was most of a prefill step's host time)."""

    def __init__(self) -> None:
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._slots: list[int] = []
        self._runs: list[tuple[int, int, Sequence[int] | torch.Tensor]] = []

    def __bool__(self) -> bool:
        return bool(self._slots) or bool(self._runs)

    def add_singles(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        """table[rows[i], cols[i]] = slots[i]."""
        self._rows.extend(rows)
        self._cols.extend(cols)
        self._slots.extend(slots)

    def add_run(self, row: int, start: int, slots: Sequence[int] | torch.Tensor) -> None:
        """table[row, start + i] = slots[i]."""
        if len(slots):
            self._runs.append((row, start, slots))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, cols, slots) as host int64 tensors, the single positions first."""
        singles = (int64_tensor(self._rows), int64_tensor(self._cols), int64_tensor(self._slots))
        if not self._runs:
            return singles
        # The runs expanded with numpy (a third of torch's time for a burst of prompts on one thread).
        run_rows, starts, parts = zip(*self._runs)
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        values = np.concatenate([(p if isinstance(p, torch.Tensor) else int64_tensor(p)).numpy() for p in parts])
        rows = np.repeat(np.array(run_rows, dtype=np.int64), lengths)
        # Position i of the concatenation is run k's (i - offset_k)-th: its column is start_k + that.
        shift = np.array(starts, dtype=np.int64) - (np.cumsum(lengths) - lengths)
        cols = np.arange(len(values), dtype=np.int64) + np.repeat(shift, lengths)
        runs = (torch.from_numpy(rows), torch.from_numpy(cols), torch.from_numpy(values))
        if not self._slots:
            return runs
        return torch.cat((singles[0], runs[0])), torch.cat((singles[1], runs[1])), torch.cat((singles[2], runs[2]))


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A host int64 tensor of values (a list or an array). Through array('q'): a decode step writes
    a position for every running request, and torch.tensor(list) takes several times longer over a
    long list (array.fromlist converts a list fastest)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    if isinstance(values, list):
        host = array("q")
        host.fromlist(values)
    else:
        host = array("q", values)
    return torch.frombuffer(host, dtype=torch.int64)
