"""Offline throughput: the in-process engine (no HTTP) on synthetic token-id workloads, with a
Hugging Face `transformers` `generate()` baseline on the same architecture in the same run.

    python -m radixserve.bench_offline --model-path benchmarks/configs/qwen2-7b --load-format dummy

Workloads (token ids drawn uniformly from the 151,643 regular Qwen2 tokens, greedy, ignore_eos, so
every request produces exactly its output length):
  * uniform: 256 sequences, input and output lengths each uniform in 100..1024;
  * random: `--num-prompts` prompts of 1024 tokens, 512 output tokens each (the seed's setting).
All requests are queued at once and the engine is stepped until every one has finished; output
tokens / wall time is the figure. The baseline runs `generate()` on static batches of
`--baseline-batch` prompts of the random workload (model built from the same config.json with
random weights, bf16, on the same GPU) and reports output tokens / wall time the same way.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from radixserve.engine.messages import GenerateRequest
from radixserve.sampling_params import SamplingParams

REGULAR_TOKENS = 151643


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def uniform_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))])
        outs.append(rng.randint(lo, hi))
    return Workload(f"uniform {n} x in/out U[{lo},{hi}]", prompts, outs)


def random_workload(n: int, input_len: int, output_len: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(n)]
    return Workload(f"random {n} x {input_len} in / {output_len} out", prompts, [output_len] * n)


@dataclass
class RunResult:
    workload: str
    requests: int
    input_tokens: int
    output_tokens: int
    seconds: float
    steps: int = 0
    decode_steps: int = 0
    graph_steps: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def run_engine(core, work: Workload) -> RunResult:
    """Queue every request at once, step until all finish; wall time includes everything."""
    runner = core.runner
    graph0, eager0 = runner.num_graph_steps, runner.num_eager_steps
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    now = time.monotonic()
    for i, (prompt, out_len) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
        core.add_request(GenerateRequest(rid=f"{work.name}-{i}", input_ids=prompt, sampling_params=params,
                                         arrival_time=now))
    produced = steps = decode_steps = decode_tokens = 0
    decode_seconds = 0.0
    while core.has_work:
        t0 = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t0
        steps += 1
        batch = core.last_step.batch
        if batch is not None and batch.is_decode_only:
            decode_steps += 1
            decode_seconds += dt
            decode_tokens += len(batch.reqs)
        produced += sum(len(o.new_token_ids) for o in outs)
    seconds = time.perf_counter() - start
    assert produced == work.output_tokens, (produced, work.output_tokens)
    core.check_invariants()
    return RunResult(work.name, len(work.prompts), work.input_tokens, produced, seconds, steps, decode_steps,
                     runner.num_graph_steps - graph0, decode_seconds, decode_tokens,
                     {"eager_steps": runner.num_eager_steps - eager0})


def run_hf_baseline(model_path: str, work: Workload, batch_size: int, seed: int) -> RunResult:
    """transformers generate() on static batches, random weights of the same config, bf16, on the GPU."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to(torch.bfloat16).eval()
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else 0

    def generate(batch: list[list[int]], new_tokens: int) -> int:
        ids = torch.tensor(batch, device="cuda")
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=eos)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    generate([p[:32] for p in work.prompts[:2]], 4)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    produced = 0
    out_len = work.output_lens[0]
    for i in range(0, len(work.prompts), batch_size):
        produced += generate(work.prompts[i:i + batch_size], out_len)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return RunResult(f"HF generate, static batches of {batch_size}: {work.name}", len(work.prompts),
                     work.input_tokens, produced, seconds)


def print_result(r: RunResult) -> None:
    line = (f"{r.workload:<58} reqs {r.requests:5d}  in {r.input_tokens:9d}  out {r.output_tokens:8d}  "
            f"{r.seconds:8.2f} s  output {r.output_tok_s:9.1f} tok/s  total {r.total_tok_s:9.1f} tok/s")
    if r.decode_steps:
        line += (f"  | steps {r.steps} (decode {r.decode_steps}, graph {r.graph_steps}), decode step "
                 f"{1e3 * r.decode_seconds / r.decode_steps:.2f} ms at mean batch "
                 f"{r.decode_tokens / r.decode_steps:.0f}")
    print(line, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixserve.bench_offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--load-format", default="dummy", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workloads", nargs="+", default=["uniform", "random"], choices=["uniform", "random"])
    p.add_argument("--uniform-prompts", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1000, help="prompts of the random workload")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--baseline-prompts", type=int, default=64, help="0 skips the HF baseline")
    p.add_argument("--baseline-batch", type=int, default=64)
    p.add_argument("--cuda-graph-max-bs", type=int, default=256)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (GPUs) of the engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_offline needs a CUDA GPU", file=sys.stderr)
        return 2

    from radixserve.engine.core import EngineCore
    from radixserve.settings import ServerSettings

    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, model {args.model_path}, date {datetime.date.today()}",
          flush=True)
    t0 = time.perf_counter()
    settings = ServerSettings(model_path=args.model_path, load_format=args.load_format, dtype=args.dtype,
                              device="cuda", cuda_graph_max_bs=args.cuda_graph_max_bs,
                              disable_cuda_graph=args.disable_cuda_graph,
                              disable_overlap_schedule=args.disable_overlap_schedule,
                              max_running_requests=args.max_running_requests, random_seed=args.seed,
                              tp_size=args.tp_size)
    core = EngineCore(settings)
    startup = time.perf_counter() - t0
    capture = core.runner.graphs.capture_seconds if core.runner.graphs is not None else 0.0
    print(f"# engine start-up {startup:.1f} s (CUDA graph capture {capture:.1f} s, warm-up included), "
          f"KV pool {core.pool_size} tokens, overlap {'on' if core.overlap else 'off'}", flush=True)
    vocab = min(REGULAR_TOKENS, core.model_config.vocab_size)

    results: list[RunResult] = []
    random_work = random_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    for name in args.workloads:
        work = (uniform_workload(args.uniform_prompts, 100, 1024, vocab, args.seed) if name == "uniform"
                else random_work)
        r = run_engine(core, work)
        print_result(r)
        results.append(r)
        core.flush_cache()  # no hits across workloads
    core.runner.graphs = None
    core.shutdown()  # the other tensor-parallel ranks, if any
    del core
    gc.collect()
    torch.cuda.empty_cache()
    print(f"# after the engine: {torch.cuda.memory_allocated() / 1e9:.1f} GB still allocated", flush=True)

    baseline = None
    if args.baseline_prompts > 0:
        base_work = random_workload(args.baseline_prompts, args.input_len, args.output_len, vocab, args.seed)
        baseline = run_hf_baseline(args.model_path, base_work, args.baseline_batch, args.seed)
        print_result(baseline)
        for r in results:
            print(f"radixserve / baseline, {r.workload}: {r.output_tok_s / baseline.output_tok_s:.2f}x "
                  f"output tok/s", flush=True)
    if args.json:
        rows = [dict(r.__dict__, output_tok_s=r.output_tok_s, total_tok_s=r.total_tok_s) for r in results]
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "startup_s": startup, "capture_s": capture, "results": rows,
                       "baseline": None if baseline is None else dict(baseline.__dict__,
                                                                       output_tok_s=baseline.output_tok_s)},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
