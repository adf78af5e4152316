"""The host tier with tensor parallelism on 2 GPUs: each rank copies its own KV shard on its own copy
stream (pinned host memory), rank 1 replaying rank 0's copies and holding its compute stream until
its loads are done. Greedy tokens with a device pool too small for the workload and a host tier
equal tp 1's without a tier in fp32, and tp 2's without a tier in bf16 (CUDA graphs on). Skipped
with fewer than 2 GPUs.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("triton")

from radixserve import Engine  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """8 system prompts of 48 tokens, 4 requests each: 32 prompts, ~2,000 tokens with their outputs."""
    model = str(build_tiny_model(tmp_path_factory.mktemp("tiny-hicache-tp-gpu"), num_heads=4, num_kv_heads=2))
    rng = random.Random(0)
    systems = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(8)]
    prompts = [s + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))] for s in systems for _ in range(4)]
    return model, prompts


def greedy(model: str, prompts: list[list[int]], **settings) -> tuple[list[list[int]], dict]:
    with Engine(model, device="cuda", cuda_graph_max_bs=16, **settings) as engine:
        runs = []
        for _ in range(2):  # the second pass finds the prompts on the host
            runs.append([r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY)])
            engine.check_invariants()
        assert runs[0] == runs[1]
        return runs[0], engine.cache_stats()


@pytest.mark.parametrize("page_size", [1, 16])
def test_tp2_fp32_with_a_host_tier_equals_tp1_without(workload, page_size):
    model, prompts = workload
    expected, _ = greedy(model, prompts, dtype="float32", max_total_tokens=8192, page_size=page_size)
    ours, stats = greedy(model, prompts, dtype="float32", tp_size=2, max_total_tokens=256, hicache_ratio=8,
                         page_size=page_size)
    assert ours == expected
    assert stats["host_hit_rate"] > 0 and stats["loaded_bytes"] > 0 and stats["written_back_bytes"] > 0


def test_tp2_bf16_with_a_host_tier_equals_tp2_without(workload):
    model, prompts = workload
    expected, _ = greedy(model, prompts, dtype="bfloat16", tp_size=2, max_total_tokens=8192)
    ours, stats = greedy(model, prompts, dtype="bfloat16", tp_size=2, max_total_tokens=256, hicache_ratio=8,
                         hicache_write_policy="write_through")
    assert ours == expected and stats["loaded_tokens"] > 0
