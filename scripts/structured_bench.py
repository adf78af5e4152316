"""Structured outputs on one GPU: a batch of `json_schema` requests against the same batch
unconstrained (output tokens per second), and the compile time of a typical tool schema.

    bash scripts/gpu_run.sh python scripts/structured_bench.py --model-path DIR_7B \
        --tokenizer-path .qwen2-tokenizer --load-format dummy

Both batches run the same prompts through the offline engine with the same max_new_tokens; the
unconstrained one with ignore_eos, the constrained one until its grammar completes (with dummy
weights the outputs are random, so the schema bounds how long they are). The figure to compare is
output tok/s; the constrained batch also pays the no-overlap steps and the bitmask.
"""

from __future__ import annotations

import argparse
import json
import time

TOOL_SCHEMA = {"type": "object", "properties": {
    "location": {"type": "string", "maxLength": 32},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "details": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
    "hourly": {"type": "boolean"}}, "required": ["location", "unit", "days", "details", "hourly"],
    "additionalProperties": False}


def run(engine, prompts: list[list[int]], params: dict) -> tuple[float, int]:
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, sum(len(o["output_ids"]) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()

    import torch

    from radixserve.engine.engine import Engine

    engine = Engine(args.model_path, tokenizer_path=args.tokenizer_path, load_format=args.load_format)
    compilers = engine.core.grammar_wait.compilers
    schema = json.dumps(TOOL_SCHEMA)
    start = time.perf_counter()
    compilers.compile("json_schema", schema).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compilers.compile("json_schema", schema).result()
    cached = time.perf_counter() - start
    print(f"tool schema compile: cold {cold * 1000:.1f} ms, cached {cached * 1e6:.0f} us")

    vocab = engine.core.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(vocab, 100000), (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.batch)]
    base = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0}
    run(engine, prompts[:4], {**base, "max_new_tokens": 8, "json_schema": schema})  # warm the mask path
    engine.flush_cache()
    for name, params in (("unconstrained", {**base, "ignore_eos": True}), ("json_schema", {**base, "json_schema": schema})):
        seconds, tokens = run(engine, prompts, params)
        engine.flush_cache()
        print(f"{name:>14}: {args.batch} requests, {tokens} output tokens in {seconds:.2f} s: "
              f"{tokens / seconds:,.0f} tok/s (mean output {tokens / args.batch:.0f} tokens)")


if __name__ == "__main__":
    main()
