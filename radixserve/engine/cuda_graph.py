"""Decode steps replayed from CUDA graphs, one graph per padded batch-size bucket.

A decode step's launches depend only on the batch size (the Triton backend's split count is a
function of it, and it reads seq_lens, req_pool_indices, out_cache_loc and req_to_token from
device memory), so one graph per bucket serves every context length. The inputs live in one
static device buffer [5, max_bs] (input_ids, positions, out_cache_loc, req_pool_indices,
seq_lens) that each step overwrites with one host-to-device copy of a pinned buffer before the
replay; two pinned buffers take turns, because with overlap scheduling the next step is written
while the previous step's copy may still be queued. An input id may be the placeholder of a token
the host has not seen yet: the graph resolves it from `LastSampledTokens` on the device. Rows
past the real batch are padding: token 0 at position 0 written to the reserved slot 0 (page 0 is
never handed out), request row 0 with seq_len 0, which attends to nothing.

All graphs share one memory pool and write their logits into one static buffer [max_bs, vocab]
(`ForwardBatch.logits_out`), so no graph keeps a tensor of its own alive in the pool: the pool
holds the largest graph's intermediates once (about 1 GB for a 7B at batch 1,024) instead of
every bucket's intermediates and logits side by side (8.5 GB with a pool per graph).
`pool_bytes` is what capture took from the device; the start-up memory plan measures it ahead by
capturing the largest bucket alone (radixserve.engine.memory_plan).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from array import array
from typing import Sequence

import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.engine.sampled_tokens import LastSampledTokens

logger = logging.getLogger("radixserve")

# Fine steps where a step's cost changes fastest (small batches), coarser ones above.
_BASE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256)

# Rows of the static input buffer.
INPUT_IDS, POSITIONS, OUT_CACHE_LOC, REQ_POOL_INDICES, SEQ_LENS = range(5)
NUM_INPUT_ROWS = 5


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Padded batch sizes to capture, ascending, the last one max_bs."""
    sizes = [b for b in _BASE_BUCKETS if b <= max_bs]
    b = 256 + 32
    while b <= max_bs:
        sizes.append(b)
        b += 32
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def supports_cuda_graphs(model: torch.nn.Module, device: torch.device) -> bool:
    """Graphs need CUDA, a backend whose decode path reads no host-side lists (the Triton one), and
    layers that read nothing back to the host (`graph_capturable`: the routed experts' reference
    loop, which runs without the Triton kernels, does)."""
    backend = getattr(model, "attn_backend", None)
    return device.type == "cuda" and hasattr(backend, "reserve_decode_workspace") and \
        getattr(model, "graph_capturable", True)


def pack_decode_inputs(host: torch.Tensor, bs: int, columns: Sequence[list[int]]) -> None:
    """Write a decode step's five input columns (in row order) into host[:, :bs], each zero-padded
    past the real batch. The host's part of a replay, runnable anywhere."""
    pad = [0] * (bs - len(columns[0]))
    # Through array('q'): torch.tensor(list) over ~1,000 requests' columns takes several times longer.
    packed = array("q")
    for column in columns:
        packed.fromlist(column)
        packed.fromlist(pad)
    host[:, :bs].copy_(torch.frombuffer(packed, dtype=torch.int64).view(NUM_INPUT_ROWS, bs))


class DecodeCudaGraphs:
    """Captures the model's decode step at each bucket and replays the smallest bucket that fits."""

    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 device: torch.device, max_bs: int, sampled: LastSampledTokens, *, largest_only: bool = False):
        """largest_only: capture the max_bs bucket alone (to measure what the graphs need)."""
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = device
        self.batch_sizes = [max_bs] if largest_only else graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.sampled = sampled
        self.inputs = torch.zeros((NUM_INPUT_ROWS, self.max_bs), dtype=torch.int64, device=device)
        self.host_inputs = [torch.zeros((NUM_INPUT_ROWS, self.max_bs), dtype=torch.int64).pin_memory()
                            for _ in range(2)]
        self._turn = 0
        self._ones = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self._arange = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        # Every graph's logits, rows [:bs]; allocated before capture, outside the graphs' pool.
        self.logits = torch.empty((self.max_bs, model.config.vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0  # device memory the capture reserved (the shared pool, mostly)

    def _run(self, bs: int) -> torch.Tensor:
        """The captured work: resolve placeholder input ids, then the model's decode step."""
        x = self.inputs
        seq_lens = x[SEQ_LENS, :bs]
        input_ids = self.sampled.resolve(x[INPUT_IDS, :bs])
        return self.model(ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=input_ids, positions=x[POSITIONS, :bs],
            out_cache_loc=x[OUT_CACHE_LOC, :bs], req_pool_indices=x[REQ_POOL_INDICES, :bs], seq_lens=seq_lens,
            extend_lens=self._ones[:bs], prefix_lens=x[POSITIONS, :bs],
            # Never read in DECODE mode by the Triton backend or the model.
            seq_lens_cpu=[0] * bs, extend_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs,
            req_to_token=self.req_to_token.table, kv_pool=self.kv_pool, logits_indices=self._arange[:bs],
            logits_out=self.logits[:bs]))

    @torch.inference_mode()
    def capture(self) -> None:
        num_heads, num_kv_heads = self.model.local_heads  # this rank's heads under tensor parallelism
        self.model.attn_backend.reserve_decode_workspace(self.max_bs, num_heads, num_kv_heads,
                                                         self.model.config.head_dim, self.device)
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        self.inputs.zero_()  # every row is a padded row while capturing
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # No garbage collection while capturing: it could destroy an earlier engine's graphs in
        # this process (unreachable cycles), which CUDA does not permit during a capture and which
        # invalidates it (seen in the GPU tests, one engine after another).
        gc.collect()
        gc_enabled = gc.isenabled()
        gc.disable()
        pool = torch.cuda.graph_pool_handle()
        try:
            # Largest first: the smaller captures then reuse its blocks in the shared pool.
            for bs in reversed(self.batch_sizes):
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile Triton kernels and let cuBLAS pick its algorithms
                        self._run(bs)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._run(bs)
                self.graphs[bs] = graph
        finally:
            if gc_enabled:
                gc.enable()
        torch.cuda.synchronize(self.device)
        # The warm-up runs' blocks, cached for the capture stream alone, go back to the device.
        torch.cuda.empty_cache()
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, %.2f GiB", len(self.graphs),
                    self.batch_sizes[0], self.max_bs, self.capture_seconds, self.pool_bytes / 2**30)

    def can_run(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_bs and bool(self.graphs)

    def bucket(self, batch_size: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    def replay(self, input_ids: list[int], positions: list[int], out_cache_loc: list[int],
               req_pool_indices: list[int], seq_lens: list[int]) -> torch.Tensor:
        """Logits [n, vocab] (a view of the graph's output, valid until the next replay)."""
        n = len(input_ids)
        bs = self.bucket(n)
        # This buffer's last copy was queued two steps ago, before a step whose results the host
        # has since waited for: it has run.
        host = self.host_inputs[self._turn]
        self._turn ^= 1
        pack_decode_inputs(host, bs, (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens))
        self.inputs.copy_(host, non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[:n]
