"""The model runner's host time per decode step and running request, without a forward pass (CPU-measurable).

    python scripts/runner_cpu_cost.py [--running 256 1024] [--repeats 3] [--steps 100] [--input-len 16]
                                      [--path eager graph] [--temperature 0.0] [--profile]

With many concurrent streams of a small model the engine process is host-bound (on an H200 a
0.5B model decoding 1,024 streams keeps the engine's one core busy while the GPU idles most of
each step). `scripts/scheduler_cpu_cost.py` measures the scheduler's share; this measures the
model runner's: building a decode step's inputs and queueing its sampling.

It runs a real `EngineCore` on the CPU over a tiny random Qwen2 (`build_tiny_model`): `--running`
requests of `--input-len` random token ids are admitted and prefilled by the real model, then
the model's forward pass is swapped for a stub that returns preset logits of a 32-token
vocabulary (so the device work left, argmax and a few small tensor operations, is negligible),
and `--steps` decode steps run through `EngineCore.step` with overlap scheduling. Every request
ignores EOS and none reaches max_new_tokens, so all keep decoding.

`--path eager` runs the eager decode path (`batch_parts` + `batch_from_parts`: the path of a
batch larger than `cuda_graph_max_bs`); `--path graph` the CUDA-graph path, whose replay runs for
real except the captured graph itself (a no-op) and with CPU buffers for the pinned and device
ones: `decode_columns` plus the packing of the five input rows.

Prints, per path and running count, microseconds per running request per decode step: the
runner's part (`launch_forward` + `launch_sampling` + the engine's grammar check `_masks_rows`)
and the whole `EngineCore.step` (the rest is the scheduler and the outputs), and milliseconds per
step of each; the best of `--repeats` (a fresh engine each). The times are this process's CPU time
(time.process_time), which other processes on a busy machine disturb less than the wall clock
(compare the best of a few repeats, taken alternately before and after a change). `--profile`
adds a cProfile of one more run of the first path at the largest count (sorted by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from radixserve.attention.base import ForwardBatch
from radixserve.engine.core import EngineCore
from radixserve.engine.cuda_graph import NUM_INPUT_ROWS, DecodeCudaGraphs, graph_batch_sizes
from radixserve.engine.messages import GenerateRequest
from radixserve.sampling_params import SamplingParams
from radixserve.settings import ServerSettings
from radixserve.testing.tiny_model import build_tiny_model
# The sibling script in scripts/ (run as `python scripts/runner_cpu_cost.py`, its folder is on the path).
from scheduler_cpu_cost import common_arguments, engine_like_collections

STUB_VOCAB = 32
WARMUP_STEPS = 4  # decode steps after the prefill before timing: the in-flight pipeline is full


class PresetLogits:
    """Stands in for the model's forward pass: the same logits every step, one row per logits index."""

    def __init__(self, rows: int):
        self.logits = torch.randn(rows, STUB_VOCAB, generator=torch.Generator().manual_seed(0))

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits[:batch.logits_indices.shape[0]]


class NoGraph:
    def replay(self) -> None:
        pass


class CpuGraphReplay(DecodeCudaGraphs):
    """`DecodeCudaGraphs.replay` as it runs on a GPU, on the CPU: its buffers are CPU tensors and each
    captured graph is a no-op whose output is the stub's logits."""

    def __init__(self, max_bs: int, logits: torch.Tensor):  # not super().__init__(): it allocates on CUDA
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.inputs = torch.zeros((NUM_INPUT_ROWS, self.max_bs), dtype=torch.int64)
        self.host_inputs = [torch.zeros((NUM_INPUT_ROWS, self.max_bs), dtype=torch.int64) for _ in range(2)]
        self._turn = 0
        self.graphs = {bs: NoGraph() for bs in self.batch_sizes}
        self.outputs = {bs: logits[:bs] for bs in self.batch_sizes}


@dataclass
class StepTimes:
    runner_s: float = 0.0
    step_s: float = 0.0


def timed(fn: Callable, times: StepTimes) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            times.runner_s += time.process_time() - start
    return wrapper


def make_engine(model_dir: str, running: int, args: argparse.Namespace, path: str) -> EngineCore:
    """An engine on the CPU with `running` requests decoding and the stub in place of the model."""
    max_new = WARMUP_STEPS + args.steps + 8
    per_request = args.input_len + max_new + 1
    settings = ServerSettings(model_path=model_dir, device="cpu", max_running_requests=running,
                              max_total_tokens=running * per_request + 1, chunked_prefill_size=running * args.input_len,
                              max_prefill_tokens=running * args.input_len, context_length=per_request + 1)
    core = EngineCore(settings)
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=max_new, temperature=args.temperature, ignore_eos=True)
    vocab = core.model_config.vocab_size
    for i in range(running):
        prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
        core.add_request(GenerateRequest(rid=f"req-{i}", input_ids=prompt, sampling_params=params))
    while len(core.scheduler.waiting) or core.last_step.batch is None or not core.last_step.batch.is_decode_only:
        core.step()  # the prefill, by the real model
    stub = PresetLogits(running)
    core.runner.model = stub
    if path == "graph":
        core.runner.graphs = CpuGraphReplay(running, stub.logits)
    for _ in range(WARMUP_STEPS):
        core.step()
    assert len(core.scheduler.running) == running, "every request should be decoding"
    return core


def measure(model_dir: str, running: int, args: argparse.Namespace, path: str,
            profile: Optional[cProfile.Profile] = None) -> StepTimes:
    """CPU time of `args.steps` decode steps with `running` requests decoding."""
    core = make_engine(model_dir, running, args, path)
    times = StepTimes()
    runner = core.runner
    runner.launch_forward = timed(runner.launch_forward, times)
    runner.launch_sampling = timed(runner.launch_sampling, times)
    core._masks_rows = timed(core._masks_rows, times)
    with engine_like_collections("runner_cpu_cost", profile):
        start = time.process_time()
        for _ in range(args.steps):
            core.step()
        times.step_s = time.process_time() - start
    assert core.last_step.batch is not None and core.last_step.batch.is_decode_only
    assert len(core.scheduler.running) == running, "every request should still be decoding"
    return times


def main() -> None:
    parser = common_arguments(__doc__.splitlines()[0], input_len=16)
    parser.add_argument("--path", nargs="+", choices=("eager", "graph"), default=["eager", "graph"],
                        help="decode paths to time (graph: the CUDA-graph replay's host work)")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of one more run of the first path at the largest count")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the stub's few tensor operations: no thread pool to wake
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp))
        for path in args.path:
            for running in args.running:
                runs = [measure(model_dir, running, args, path) for _ in range(args.repeats)]
                best = min(runs, key=lambda t: t.runner_s)
                per_request_us = 1e6 / (args.steps * running)
                print(f"{path:5s} {running:5d} running: runner {best.runner_s * per_request_us:.2f} us per request "
                      f"per decode step ({best.runner_s / args.steps * 1e3:.2f} ms per step); whole step "
                      f"{min(t.step_s for t in runs) * per_request_us:.2f} us per request", flush=True)
        if args.profile:
            profile = cProfile.Profile()
            measure(model_dir, max(args.running), args, args.path[0], profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
