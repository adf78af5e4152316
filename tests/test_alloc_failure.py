"""A step the device cannot allocate for never kills the engine: it is taken back, later steps get
smaller, every request is still served with the tokens it would have had, and every KV slot comes
back. The failure is injected where a step allocates (an MLP activation in the last layer, so
earlier layers have already written KV; the sampler; logit processing); on the CPU nothing else
can make torch raise `OutOfMemoryError`."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from radixserve.engine import model_runner
from radixserve.scheduler.scheduler import MIN_STEP_PREFILL_TOKENS
from radixserve.testing.tiny_model import build_tiny_model

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PENALISED = {**GREEDY, "repetition_penalty": 1.3}


class FailWhen:
    """Raises OutOfMemoryError instead of calling `inner` while `condition(args)` holds, at most
    `times` times."""

    def __init__(self, inner, condition, times: int):
        self.inner, self.condition, self.left, self.raised = inner, condition, times, 0

    def __call__(self, *args, **kwargs):
        if self.left > 0 and self.condition(args):
            self.left -= 1
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 330.00 MiB (injected)")
        return self.inner(*args, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("alloc-failure"))


def prompts() -> list[list[int]]:
    shared = [(5 * i) % 500 + 3 for i in range(300)]
    return [shared + [(7 * i + j) % 500 + 3 for j in range(20 + i)] for i in range(12)] + \
        [[(11 * j) % 500 + 3 for j in range(400)]]


def check_idle(engine: Engine) -> None:
    engine.check_invariants()
    stats = engine.cache_stats()
    assert stats["running_requests"] == stats["queued_requests"] == 0
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["pool_tokens"]


def run(model_dir, params, inject=None, **settings):
    engine = Engine(str(model_dir), max_total_tokens=8192, chunked_prefill_size=1024, **settings)
    fault = inject(engine) if inject is not None else None
    results = engine.generate(input_ids=prompts(), sampling_params=params)
    check_idle(engine)
    return engine, fault, [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in results]


def fail_big_mlp(engine: Engine, times: int = 2) -> FailWhen:
    """The last layer's MLP fails on any input of more than MIN_STEP_PREFILL_TOKENS rows."""
    mlp = engine.core.model.model.layers[-1].mlp
    mlp.forward = FailWhen(mlp.forward, lambda args: args[0].shape[0] > MIN_STEP_PREFILL_TOKENS, times)
    return mlp.forward


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prefill_step_that_cannot_allocate_is_taken_back_and_halved(model_dir, overlap):
    _, _, expected = run(model_dir, GREEDY, disable_overlap_schedule=not overlap)
    engine, fault, got = run(model_dir, GREEDY, fail_big_mlp, disable_overlap_schedule=not overlap)
    assert fault.raised == 2
    assert got == expected
    stats = engine.cache_stats()
    assert stats["alloc_failures"] == 2
    assert engine.core.scheduler.prefill_cap == MIN_STEP_PREFILL_TOKENS  # 1,024 -> 512 -> 256


def test_a_failing_sampler_lowers_the_running_requests(model_dir, monkeypatch):
    """The penalty pass fails on a batch of more than two rows: 5 rows -> 3 -> 2 (the first
    prompt's chunks leave a quarter of each step to the others, so 5 rows is the widest step)."""
    _, _, expected = run(model_dir, PENALISED, max_prefill_tokens=200)

    def inject(engine):
        fault = FailWhen(model_runner.process_logits, lambda args: args[0].shape[0] > 2, 10)
        monkeypatch.setattr(model_runner, "process_logits", fault)
        return fault

    engine, fault, got = run(model_dir, PENALISED, inject, max_prefill_tokens=200)
    assert fault.raised == 2
    assert got == expected
    assert engine.core.scheduler.max_running == 2
    assert engine.cache_stats()["alloc_failures"] == 2


def test_a_one_request_step_that_keeps_failing_fails_that_request_only(model_dir, monkeypatch):
    """Sampling for the 400-token prompt (the last one) never succeeds: that request ends with an
    error once its step is as small as steps get; the others are served as usual."""
    _, _, expected = run(model_dir, GREEDY)
    long_prompt = prompts()[-1]

    def inject(engine):
        def its_batch(args):
            return any(r.origin_input_ids == long_prompt for r in args[1])

        fault = FailWhen(model_runner.ModelRunner.process_logits, lambda args: its_batch(args[1:]), 100)
        monkeypatch.setattr(model_runner.ModelRunner, "process_logits",
                            lambda self, logits, sampling: fault(self, logits, sampling))
        return fault

    params = {**GREEDY, "repetition_penalty": 1.0, "min_new_tokens": 1}  # processes logits, changes nothing
    engine, fault, got = run(model_dir, params, inject)
    assert got[:-1] == expected[:-1]
    assert got[-1][1]["type"] == "abort" and "out of memory" in got[-1][1]["message"]
    assert fault.raised >= 1


def test_the_memory_profile_step_runs_every_path_of_the_largest_step(model_dir):
    """What the start-up plan measures on a GPU, run on the CPU: one prompt chunk of the settings'
    size with PROFILE_PROMPT_LOGPROB_ROWS prompt log-probability rows beside max_running - 1
    decoding rows, every row sampling with filters, penalties and top log probabilities."""
    from radixserve.cache.kv_pool import ReqToTokenPool
    from radixserve.engine.memory_plan import PROFILE_PROMPT_LOGPROB_ROWS, profile_step

    engine = Engine(str(model_dir), max_total_tokens=4096, chunked_prefill_size=1200)
    table = ReqToTokenPool(6, engine.core.context_len + 1, "cpu")
    runner, batch = profile_step(engine.settings, engine.core.model, table, torch.device("cpu"), torch.float32,
                                 engine.core.context_len)
    assert batch.num_new_tokens == 1200 and len(batch.reqs) == 6
    future = runner.launch(batch)
    ids = future.result()
    assert len(ids) == 6
    assert all(entry is not None and len(entry.top_ids) == 20 for entry in future.logprobs())
    prompt_rows = future.prompt_logprobs()
    assert len(prompt_rows[0]) == PROFILE_PROMPT_LOGPROB_ROWS and not any(prompt_rows[1:])



def fail_sampling(engine: Engine, times: int = 3) -> FailWhen:
    """Rank 0's penalty pass fails on a batch of more than two rows: before the sampled ids are
    broadcast, so the other ranks wait in that broadcast."""
    runner = engine.core.runner
    runner.process_logits = FailWhen(runner.process_logits, lambda args: args[0].shape[0] > 2, times)
    return runner.process_logits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inject, params, settings, failures", [
    (fail_big_mlp, GREEDY, {}, 2),
    (fail_sampling, PENALISED, {"max_prefill_tokens": 200}, 2),
], ids=["mid-forward", "before-the-ids-broadcast"])
def test_under_tp2_every_rank_gives_the_failed_step_up_and_the_engine_goes_on(model_dir, inject, params, settings,
                                                                              failures):
    """tp_size 2 over gloo: rank 0 fails inside the forward (the other rank waits in the last
    layer's all-reduce) or in sampling (it waits in the ids broadcast). Both ranks give the step up
    and join a new group; every request gets the tokens it gets at tp_size 1, and every slot is back."""
    single, _, expected = run(model_dir, params, **settings)
    engine, fault, got = run(model_dir, params, inject, tp_size=2, **settings)
    try:
        assert fault.raised == failures
        assert got == expected
        assert engine.cache_stats()["alloc_failures"] == failures
        assert engine.core.ranks.tp.generation == failures  # one new group per step given up
        # The new group computes as the first did: the same follow-up as the tp_size 1 engine's.
        follow_up = prompts()[:3]
        assert [r["output_ids"] for r in engine.generate(input_ids=follow_up, sampling_params=params)] == \
            [r["output_ids"] for r in single.generate(input_ids=follow_up, sampling_params=params)]
        check_idle(engine)
    finally:
        engine.shutdown()
