"""The model runner's host-side step building: decode columns, the CUDA-graph input packing (its
CPU part), the batch sampling flags, the int64 index tensors and the request table's batched writes."""

from __future__ import annotations

from array import array

import pytest
import torch

from radixserve.cache.kv_pool import ReqToTokenPool, TableWrites, int64_tensor
from radixserve.engine.cuda_graph import NUM_INPUT_ROWS, pack_decode_inputs
from radixserve.engine.model_runner import ModelRunner, _token_at
from radixserve.sampling_params import (CONSTRAINED, PROCESSES_LOGITS, RETURNS_LOGPROBS, SAMPLES, SEEDED,
                                        SamplingParams)
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.request import Req


def decoding_req(row: int, prompt_len: int, outputs: int, pending: int) -> Req:
    req = Req(rid=f"r{row}", origin_input_ids=[100 + i for i in range(prompt_len)], sampling_params=SamplingParams(),
              arrival_time=0.0, arrival_seq=row)
    req.output_ids = [200 + i for i in range(outputs)]
    req.req_pool_idx = row
    req.pending = pending
    req.slots = [1000 * (row + 1) + i for i in range(prompt_len + outputs + 2)]
    return req


def test_decode_columns_match_the_token_at_each_position():
    # The newest token on the device (overlap scheduling), the host's last output token, and the
    # first decode step after a prefill whose token is still in flight.
    cases = [(decoding_req(0, 5, 3, pending=2), 5 + 3), (decoding_req(1, 4, 6, pending=1), 4 + 6 - 1),
             (decoding_req(2, 7, 0, pending=2), 7), (decoding_req(3, 1, 1, pending=1), 1)]
    batch = ScheduledBatch()
    batch.add_decode([r for r, _ in cases], [p for _, p in cases])
    input_ids, positions, out_cache_loc, rows, seq_lens = ModelRunner.decode_columns(batch)
    assert input_ids == [_token_at(r, p) for r, p in cases]
    assert input_ids == [-1, 205, -3, 200]  # placeholders are -(row + 1)
    assert positions == [p for _, p in cases]
    assert out_cache_loc == [r.slots[p] for r, p in cases]
    assert rows == [0, 1, 2, 3]
    assert seq_lens == [p + 1 for _, p in cases]


@pytest.mark.parametrize("n,bs", [(1, 1), (3, 4), (250, 256)])
def test_graph_inputs_are_packed_row_by_row_with_zero_padding(n, bs):
    columns = [[(row + 1) * 10_000 + i - 5 for i in range(n)] for row in range(NUM_INPUT_ROWS)]
    host = torch.full((NUM_INPUT_ROWS, 300), 7, dtype=torch.int64)
    pack_decode_inputs(host, bs, columns)
    for row, column in enumerate(columns):
        assert host[row, :n].tolist() == column
        assert host[row, n:bs].tolist() == [0] * (bs - n)
    assert bool((host[:, bs:] == 7).all())  # past the bucket: untouched


@pytest.mark.parametrize("params,flags", [
    (SamplingParams(temperature=0.0), 0),
    (SamplingParams(temperature=0.7), SAMPLES),
    (SamplingParams(temperature=0.7, top_k=1), 0),  # top_k 1 is greedy
    (SamplingParams(temperature=0.7, seed=3), SAMPLES | SEEDED),
    (SamplingParams(temperature=0.0, seed=3), 0),  # a greedy request never draws from its generator
    (SamplingParams(temperature=0.0, logit_bias={5: 1.0}), PROCESSES_LOGITS),
    (SamplingParams(temperature=0.0, min_new_tokens=2), PROCESSES_LOGITS),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), PROCESSES_LOGITS),
    (SamplingParams(temperature=0.0, return_logprob=True), RETURNS_LOGPROBS),
    (SamplingParams(temperature=0.0, regex="a+"), CONSTRAINED),
    (SamplingParams(temperature=0.0, json_schema="{}"), CONSTRAINED),
])
def test_sampling_flags_say_which_passes_a_request_needs(params, flags):
    assert params.sampling_flags() == flags
    req = Req(rid="r", origin_input_ids=[1], sampling_params=params, arrival_time=0.0, arrival_seq=0)
    assert req.sampling_flags == flags


def test_int64_tensor_from_a_list_an_array_or_nothing():
    assert int64_tensor([3, -1, 2**40]).tolist() == [3, -1, 2**40]
    assert int64_tensor(array("q", [4, 5])).tolist() == [4, 5]
    assert int64_tensor(range(3)).tolist() == [0, 1, 2]
    empty = int64_tensor([])
    assert empty.dtype == torch.int64 and empty.numel() == 0


def test_table_writes_apply_single_positions_and_runs_as_assigned_one_by_one():
    pool, expected = ReqToTokenPool(4, 16, "cpu"), torch.zeros((4, 16), dtype=torch.int64)
    writes = TableWrites()
    assert not writes
    writes.add_run(2, 0, torch.tensor([7, 8, 9]))  # a cached prefix's slots, as the tree holds them
    writes.add_run(0, 5, [40, 41])  # newly allocated slots, a list
    writes.add_run(3, 1, [])  # nothing: no write
    writes.add_singles([1, 2], [4, 3], [50, 60])  # two decoding requests' next positions
    writes.add_run(1, 10, array("q", [70, 71, 72]))
    assert writes
    for row, col, slot in [(2, 0, 7), (2, 1, 8), (2, 2, 9), (0, 5, 40), (0, 6, 41), (1, 4, 50), (2, 3, 60),
                           (1, 10, 70), (1, 11, 71), (1, 12, 72)]:
        expected[row, col] = slot
    pool.write(writes)
    assert torch.equal(pool.table, expected)
