"""The engine's host time per decode step and running request, without a model (CPU-measurable).

    python scripts/scheduler_cpu_cost.py [--running 256 1024] [--repeats 3] [--steps 100] [--input-len 512]
                                         [--page-size 1] [--profile]
    python scripts/scheduler_cpu_cost.py --burst [--repeats 3] [--profile]

With many concurrent streams of a small model the engine process is host-bound: on an H200 a
0.5B model decoding 1,024 streams keeps the engine's one core busy while the GPU idles most of
each step, and most of that time is Python spent per running request. This measures that part
with the real `Scheduler`, radix cache, KV allocator and request table (on the CPU) and no model:
`--running` requests of `--input-len` random token ids are admitted and prefilled, then
`--steps` decode steps run the way `EngineCore.step` drives them with overlap scheduling:
`schedule(previous)` builds step N+1 while step N is still in flight, then `collect(previous)`
processes step N's tokens (ids drawn in advance; none is an end-of-sequence token and no request
reaches max_new_tokens, so all keep running). Each updated request then becomes a `RequestOutput`
(`request_output`) and the step's outputs one encoded message to the API process.

`--burst` measures the admission of a burst instead, the 0.5B gsp run's first two seconds: 1,024
requests (64 groups of 16 sharing 2,048-token system prompts, 128-token questions), 60 more
arriving before each step, prefilled 8,192 tokens a step under LPM until all run; it prints the
scheduler's CPU time over those steps (the best of `--repeats`).

Prints, per running count, microseconds per running request per decode step, in all and split
into the scheduler's part (`schedule` + `collect`) and the outputs', and milliseconds per step:
the best of `--repeats` (a fresh scheduler each). The times are this process's CPU time
(time.process_time), which other processes on a busy machine disturb less than the wall clock
(they still slow it through shared caches and clocks: compare the best of a few repeats, taken
alternately before and after a change). `--profile` adds a cProfile of one more run at the
largest count (sorted by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from radixserve.cache.kv_pool import PageAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.engine.core import request_output
from radixserve.process.gc_tuning import FullCollectionGovernor, freeze_startup_objects
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.batch import StepInFlight
from radixserve.scheduler.request import Req
from radixserve.scheduler.scheduler import Scheduler
from radixserve.engine import messages as m
from radixserve.settings import ServerSettings

VOCAB = 150_000
EOS_TOKEN_IDS = [VOCAB, VOCAB + 1]  # never drawn: every request keeps decoding


class PresetTokens:
    """A `TokenFuture` whose ids are known in advance (no model ran)."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.wait_s = 0.0

    def result(self) -> list[int]:
        return self.ids

    def logprobs(self) -> None:
        return None

    def prompt_logprobs(self) -> None:
        return None


@dataclass
class StepTimes:
    scheduler_s: float = 0.0
    outputs_s: float = 0.0


def make_scheduler(running: int, input_len: int, max_new_tokens: int, page_size: int,
                   rng: random.Random) -> Scheduler:
    """A scheduler over a pool with room for every request, `running` requests queued."""
    context = input_len + max_new_tokens + page_size
    pool = running * context + page_size
    settings = ServerSettings(max_total_tokens=pool, device="cpu", page_size=page_size,
                              chunked_prefill_size=running * input_len, max_prefill_tokens=running * input_len)
    cache = RadixCache(PageAllocator(pool, page_size), page_size=page_size)
    scheduler = Scheduler(settings, cache, ReqToTokenPool(running, context, "cpu"), context_len=context,
                          eos_token_ids=EOS_TOKEN_IDS)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    for i in range(running):
        prompt = [rng.randrange(VOCAB) for _ in range(input_len)]
        scheduler.add_request(Req(rid=f"req-{i}", origin_input_ids=prompt, sampling_params=params,
                                  arrival_time=0.0, arrival_seq=-1))
    return scheduler


def schedule_and_collect(scheduler: Scheduler, previous: Optional[StepInFlight],
                         token_ids: list[int]) -> tuple[StepInFlight, list[Req]]:
    """One overlapped step: build and "launch" the next batch, then collect the one before it."""
    batch = scheduler.schedule(previous)
    current = StepInFlight(batch, PresetTokens(token_ids[:sum(batch.sample)]))
    return current, scheduler.collect(previous) if previous is not None else []


def send_outputs(updated: list[Req]) -> None:
    """What the engine hands the API for those requests: their outputs, as one encoded message."""
    m.encode(m.OutputBatch(outputs=[request_output(r) for r in updated], errors=[], stats=None, kv_events=[]))


def run_steps(scheduler: Scheduler, steps: int, token_ids: list[int], times: Optional[StepTimes]) -> None:
    """Drive the overlap loop for `steps` steps; times (when given) gets the CPU time of each part."""
    previous: Optional[StepInFlight] = None
    for _ in range(steps):
        start = time.process_time()
        current, updated = schedule_and_collect(scheduler, previous, token_ids)
        collected = time.process_time()
        send_outputs(updated)
        if times is not None:
            times.scheduler_s += collected - start
            times.outputs_s += time.process_time() - collected
        previous = current
    if previous is not None:
        scheduler.collect(previous)


def measure(running: int, args: argparse.Namespace, profile: Optional[cProfile.Profile] = None) -> StepTimes:
    """Host CPU time of `args.steps` decode steps with `running` requests decoding."""
    rng = random.Random(0)
    warmup = 4  # the prefill step, then decode steps until the in-flight pipeline is full
    scheduler = make_scheduler(running, args.input_len, warmup + args.steps + 2, args.page_size, rng)
    token_ids = [rng.randrange(VOCAB) for _ in range(running)]
    run_steps(scheduler, warmup, token_ids, None)
    assert len(scheduler.running) == running and not len(scheduler.waiting), "every request should be decoding"
    times = StepTimes()
    with engine_like_collections("scheduler_cpu_cost", profile):
        run_steps(scheduler, args.steps, token_ids, times)
    return times


@contextmanager
def engine_like_collections(name: str, profile: Optional[cProfile.Profile]) -> Iterator[None]:
    """The timed steps, as in the engine process: what was built before is frozen, full collections
    are kept off the busy path, young collections run as usual; profiled when asked."""
    freeze_startup_objects()
    governor = FullCollectionGovernor(name).install()
    if profile is not None:
        profile.enable()
    try:
        yield
    finally:
        if profile is not None:
            profile.disable()
        governor.uninstall()
        gc.unfreeze()


def common_arguments(description: str, input_len: int) -> argparse.ArgumentParser:
    """The options both host-cost scripts take (this one and scripts/runner_cpu_cost.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024], help="running requests (each a run)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per count; the best is reported")
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per run")
    parser.add_argument("--input-len", type=int, default=input_len, help="prompt tokens per request")
    return parser


def burst_cpu_seconds(profile: Optional[cProfile.Profile] = None) -> tuple[float, int]:
    """CPU seconds of the scheduling steps that admit and prefill a gsp burst, and their count."""
    rng = random.Random(0)
    groups, per_group, system_len, question_len, arriving_per_step = 64, 16, 2048, 128, 60
    systems = [[rng.randrange(VOCAB) for _ in range(system_len)] for _ in range(groups)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(question_len)] for system in systems
               for _ in range(per_group)]
    rng.shuffle(prompts)
    running, context, pool = len(prompts), system_len + question_len + 64, 1_500_000
    settings = ServerSettings(max_total_tokens=pool, device="cpu", schedule_policy="lpm", max_running_requests=running)
    scheduler = Scheduler(settings, RadixCache(PageAllocator(pool, 1), page_size=1),
                          ReqToTokenPool(running, context, "cpu"), context_len=context, eos_token_ids=EOS_TOKEN_IDS)
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    token_ids = [rng.randrange(VOCAB) for _ in range(running)]
    previous: Optional[StepInFlight] = None
    sent, steps, cpu_s = 0, 0, 0.0
    with engine_like_collections("scheduler_cpu_cost", profile):
        while sent < len(prompts) or len(scheduler.waiting):
            for prompt in prompts[sent:sent + arriving_per_step]:
                scheduler.add_request(Req(rid=f"req-{sent}", origin_input_ids=prompt, sampling_params=params,
                                          arrival_time=time.monotonic(), arrival_seq=-1))
                sent += 1
            start = time.process_time()
            previous, updated = schedule_and_collect(scheduler, previous, token_ids)
            send_outputs(updated)
            cpu_s += time.process_time() - start
            steps += 1
    return cpu_s, steps


def main() -> None:
    parser = common_arguments(__doc__.splitlines()[0], input_len=512)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one more run at the largest count")
    parser.add_argument("--burst", action="store_true", help="measure the admission of a gsp burst instead")
    args = parser.parse_args()
    if args.burst:
        cpu_s, steps = min(burst_cpu_seconds() for _ in range(args.repeats))
        print(f"gsp burst: {cpu_s:.3f} s of scheduler CPU time over {steps} steps ({cpu_s / steps * 1e3:.1f} ms a step)")
        if args.profile:
            profile = cProfile.Profile()
            burst_cpu_seconds(profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
        return
    for running in args.running:
        runs = [measure(running, args) for _ in range(args.repeats)]
        best = min(runs, key=lambda t: t.scheduler_s + t.outputs_s)
        per_request_us = 1e6 / (args.steps * running)
        total_s = best.scheduler_s + best.outputs_s
        print(f"{running:5d} running: {total_s * per_request_us:.2f} us per request per decode step "
              f"(scheduler {best.scheduler_s * per_request_us:.2f}, outputs {best.outputs_s * per_request_us:.2f}), "
              f"{total_s / args.steps * 1e3:.2f} ms per step", flush=True)
    if args.profile:
        profile = cProfile.Profile()
        measure(max(args.running), args, profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
