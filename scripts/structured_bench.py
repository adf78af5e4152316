"""Structured outputs on one GPU: a batch of `json_schema` requests against the same batch
unconstrained (output tokens per second), and the compile time of a typical tool schema.

    bash scripts/gpu_run.sh python scripts/structured_bench.py --model-path DIR_7B \
        --tokenizer-path .qwen2-tokenizer --load-format dummy

Both batches run the same prompts through the offline engine; the constrained one until its grammar
completes (with dummy weights the outputs are random, so the schema bounds how long they are), and
the unconstrained one with ignore_eos and, request by request, the same number of output tokens
(so both pay the same prefill and the same shrinking batch). The figure to compare is output
tok/s; the constrained batch also pays the bitmask fill and masking. The tool schema bounds its
strings with `maxLength` (slow to fill before xgrammar 0.2.9); the same schema without its
`maxLength`s is run as well.
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


def run(engine, prompts: list[list[int]], params) -> tuple[float, int, list[int]]:
    """Seconds, output tokens and each request's output length of one batch (params: one dict, or
    one per prompt)."""
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    lengths = [len(o["output_ids"]) for o in outs]
    return time.perf_counter() - start, sum(lengths), lengths


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
    seconds, tokens, _ = run(engine, prompts, {**base, "ignore_eos": True})
    engine.flush_cache()
    report(f"unconstrained, {args.max_new_tokens} tokens each", args.batch, seconds, tokens)
    for name, text in (("json_schema (tool schema)", schema), ("json_schema (no maxLength)", json.dumps(unbounded(TOOL_SCHEMA)))):
        seconds, tokens, lengths = run(engine, prompts, {**base, "json_schema": text})
        engine.flush_cache()
        report(name, args.batch, seconds, tokens)
        matched = [{**base, "max_new_tokens": max(1, n), "ignore_eos": True} for n in lengths]
        seconds, tokens, _ = run(engine, prompts, matched)
        engine.flush_cache()
        report("  unconstrained, same lengths", args.batch, seconds, tokens)


def report(name: str, batch: int, seconds: float, tokens: int) -> None:
    print(f"{name:>32}: {batch} requests, {tokens} output tokens in {seconds:.2f} s: {tokens / seconds:,.0f} tok/s "
          f"(mean output {tokens / batch:.0f} tokens)")


def unbounded(schema):
    """The schema without its string length bounds."""
    if isinstance(schema, dict):
        return {k: unbounded(v) for k, v in schema.items() if k not in ("maxLength", "minLength")}
    if isinstance(schema, list):
        return [unbounded(v) for v in schema]
    return schema


if __name__ == "__main__":
    main()
