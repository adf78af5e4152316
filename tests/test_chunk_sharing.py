"""A prompt mid-way through its chunks shares each step (Scheduler._share_with_chunks): everyone
else takes up to --chunked-prefill-reserve of the budget first (decode rows, waiting prompts that
fit whole, one longer prompt started in pieces), the long prompt's chunk the rest. Steps are
driven one at a time, so every assertion is about which request got which tokens in which step."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.engine.messages import GenerateRequest
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.request import ReqState
from radixserve.settings import ServerSettings
from radixserve.testing.tiny_model import build_tiny_model

BUDGET = 512
SHARE = BUDGET // 4  # the default reserve, 0.25
# Arrival times an hour ahead of the engine's clock: no request is overdue for LPM's wait bound.
CLOCK_BASE = time.monotonic() + 3600.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-chunk-sharing"))


def make_engine(tiny_dir: Path, **settings) -> Engine:
    return Engine(str(tiny_dir), max_total_tokens=30000, chunked_prefill_size=BUDGET, max_prefill_tokens=BUDGET,
                  context_length=8192, **settings)


def request(rid: str, ids: list[int], t: float, max_new: int = 1) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=ids, arrival_time=CLOCK_BASE + t,
                           sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True))


class Stepper:
    """Schedules and runs one step at a time (no overlap): what each request computed, what finished."""

    def __init__(self, engine: Engine):
        self.core, self.sched = engine.core, engine.core.scheduler

    def add(self, rid: str, ids: list[int], t: float, max_new: int = 1) -> None:
        self.core.add_request(request(rid, ids, t, max_new))

    def step(self) -> tuple[dict[str, int], list[str]]:
        """{rid: tokens computed this step} (a decode row computes 1), and the requests it finished."""
        batch = self.sched.schedule()
        assert batch is not None
        updated = self.sched.process_results(batch, self.core.runner.forward(batch))
        assert batch.num_new_tokens <= BUDGET
        return ({r.rid: n for r, n in zip(batch.reqs, batch.extend_lens)},
                [r.rid for r in updated if r.state is ReqState.FINISHED])

    def finish(self) -> list[str]:
        done = []
        while self.sched.has_work:
            done += self.step()[1]
        self.core.check_invariants()
        return done


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def test_short_requests_go_first_and_the_long_chunk_takes_the_rest(tiny_dir):
    """A 2-token request that arrives while a 6,000-token prompt is mid-way is computed in the next
    step and its decode rows ride along (each costing the chunk one token); a 300-token prompt,
    too long for the share, starts in pieces of it; the long prompt never gets less than the budget
    less the share."""
    run = Stepper(make_engine(tiny_dir))
    rng = random.Random(1)
    run.add("long", ids(rng, 6000), 0.0)
    assert run.step() == ({"long": BUDGET}, [])
    run.add("short", ids(rng, 2), 1.0, max_new=3)
    assert run.step() == ({"short": 2, "long": BUDGET - 2}, [])
    assert run.step() == ({"short": 1, "long": BUDGET - 1}, [])  # its decode row
    run.add("medium", ids(rng, 300), 2.0)
    # The decode row and the medium prompt's first piece share the reserve with nothing left over.
    assert run.step() == ({"short": 1, "medium": SHARE, "long": BUDGET - SHARE}, ["short"])
    assert run.step() == ({"medium": SHARE, "long": BUDGET - SHARE}, [])
    assert run.step() == ({"medium": 300 - 2 * SHARE, "long": BUDGET - (300 - 2 * SHARE)}, ["medium"])
    long = run.sched.reqs["long"]
    assert long.kv_len == 2 * BUDGET + (BUDGET - 1) + 3 * BUDGET - 300 - 2
    assert run.finish() == ["long"]


def test_waiting_prompts_that_fit_the_share_go_in_policy_order(tiny_dir):
    """Two 100-token prompts wait beside a long one and the share fits one whole: LPM takes the one
    with the longer cached prefix, the other starts in what is left of the share and ends in the
    next step."""
    run = Stepper(make_engine(tiny_dir))
    rng = random.Random(2)
    system = ids(rng, 64)
    run.add("system", system, 0.0)
    run.finish()
    run.add("long", ids(rng, 4000), 1.0)
    run.step()
    run.add("fresh", ids(rng, 100), 2.0)
    run.add("cached", system + ids(rng, 100), 3.0)  # arrived later, but 64 of its tokens are cached
    assert run.step() == ({"cached": 100, "fresh": SHARE - 100, "long": BUDGET - SHARE}, ["cached"])
    assert run.step() == ({"fresh": 200 - SHARE, "long": BUDGET - (200 - SHARE)}, ["fresh"])
    assert run.sched.stats.admitted == 4
    run.finish()


def test_a_request_continuing_the_long_prompt_waits_for_its_chunks(tiny_dir):
    """A request whose prompt extends the first 2,000 tokens of the long prompt is not started in
    the share (it would compute again what the long prompt is computing): it waits until those
    chunks are cached, then computes only its own 50 tokens. An unrelated prompt is not held up."""
    run = Stepper(make_engine(tiny_dir))
    rng = random.Random(3)
    long = ids(rng, 6000)
    run.add("long", long, 0.0)
    run.step()
    run.add("continues", long[:2000] + ids(rng, 50), 1.0)
    run.add("other", ids(rng, 40), 2.0)
    assert run.step() == ({"other": 40, "long": BUDGET - 40}, ["other"])
    long_req, continues = run.sched.reqs["long"], run.sched.reqs["continues"]
    while True:
        cached_before = long_req.locked_len
        computed = run.step()[0]
        if "continues" in computed:
            break
        assert continues.state is ReqState.WAITING
    assert cached_before >= 2000 and computed["continues"] == 50 and continues.cached_tokens == 2000
    assert run.finish() == ["long"]


def test_no_reserve_lets_the_chunk_take_the_whole_budget(tiny_dir):
    """--chunked-prefill-reserve 0: the long prompt's chunks take every step's budget and a short
    request waits until the long prompt is computed."""
    run = Stepper(make_engine(tiny_dir, chunked_prefill_reserve=0.0))
    rng = random.Random(4)
    run.add("long", ids(rng, 2000), 0.0)
    run.step()
    run.add("short", ids(rng, 2), 1.0)
    assert run.step() == ({"long": BUDGET}, [])
    assert run.step() == ({"long": BUDGET}, [])
    assert run.step() == ({"long": 2000 - 3 * BUDGET, "short": 2}, ["long", "short"])


def test_the_cpu_default_chunk_is_smaller_than_the_gpu_one():
    settings = ServerSettings()
    assert settings.resolved_chunked_prefill_size("cpu") == 1024
    assert settings.resolved_chunked_prefill_size("cuda") == 8192
    assert ServerSettings(chunked_prefill_size=-1).resolved_chunked_prefill_size("cpu") == -1
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="chunked_prefill_reserve"):
            ServerSettings(chunked_prefill_reserve=bad)
