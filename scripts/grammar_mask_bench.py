"""Host cost per step of the grammar mask path at a batch of constrained requests (CPU-measurable).

    python scripts/grammar_mask_bench.py --tokenizer-path .qwen2-tokenizer --batch 64

Drives `--batch` matchers of the structured-outputs benchmark's tool schema through valid JSON
documents (staggered, so the rows sit in different states) and times, per step, what the engine
does for a constrained step: xgrammar's batched fill into the persistent bitmask buffer
(`GrammarMask`), and masking the [batch, vocab] logits from the packed bitmask (here with the CPU
fallback; on a GPU one Triton kernel). `--schema unbounded` drops the schema's `maxLength`s:
xgrammar 0.2.8 fills masks inside a `maxLength` string orders of magnitude slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from structured_bench import TOOL_SCHEMA  # noqa: E402


def unbounded(schema):
    if isinstance(schema, dict):
        return {k: unbounded(v) for k, v in schema.items() if k not in ("maxLength", "minLength")}
    if isinstance(schema, list):
        return [unbounded(v) for v in schema]
    return schema


def documents(tokenizer, n: int) -> list[list[int]]:
    docs = []
    for i in range(n):
        doc = {"location": f"City number {i} of the north", "unit": ["celsius", "fahrenheit"][i % 2],
               "days": 1 + i % 14, "details": [f"d{j}x{i}" for j in range(i % 5)], "hourly": bool(i % 3)}
        docs.append(tokenizer.encode(json.dumps(doc, separators=(", ", ": ")), add_special_tokens=False))
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-path", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schema", choices=["tool", "unbounded"], default="tool")
    parser.add_argument("--fill-threads", type=int, default=None, help="default: the engine's FILL_THREADS")
    args = parser.parse_args()

    import torch
    import xgrammar
    from transformers import AutoTokenizer

    from radixserve.engine.grammar_mask import GrammarMask
    from radixserve.grammar.backend import FILL_THREADS, GrammarCompilers, RequestGrammar
    from radixserve.model.sampler import apply_token_bitmask_
    from radixserve.sampling_params import SamplingParams
    from radixserve.scheduler.request import Req

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    vocab = max(len(tokenizer), getattr(tokenizer, "vocab_size", 0))
    compilers = GrammarCompilers(tokenizer, vocab, [tokenizer.eos_token_id])
    threads = args.fill_threads or FILL_THREADS
    compilers.batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=threads)
    schema = TOOL_SCHEMA if args.schema == "tool" else unbounded(TOOL_SCHEMA)
    compiled = compilers.compile("json_schema", json.dumps(schema)).result()
    reqs = []
    for i in range(args.batch):
        req = Req(rid=str(i), origin_input_ids=[0], sampling_params=SamplingParams(), arrival_time=0.0, arrival_seq=i)
        req.grammar = RequestGrammar(compiled)
        reqs.append(req)
    docs = documents(tokenizer, args.batch)
    for i, req in enumerate(reqs):  # stagger the rows
        for token in docs[i][:i % 7]:
            assert req.grammar.accept(token)
    mask = GrammarMask(compilers, args.batch, torch.device("cpu"))
    logits = torch.randn(args.batch, vocab)
    fills, applies = [], []
    for step in range(args.steps):
        rows = GrammarMask.constrained_rows(reqs)
        if not rows:
            break
        view = mask.host[mask.head:mask.head + len(rows) * mask.words].view(len(rows), mask.words)
        start = time.perf_counter()
        compilers.fill_bitmask([reqs[i].grammar for i in rows], view)
        filled = time.perf_counter()
        apply_token_bitmask_(logits, view, torch.tensor(rows, dtype=torch.int32))
        done = time.perf_counter()
        fills.append(filled - start)
        applies.append(done - filled)
        for i in rows:
            k = i % 7 + step
            if k < len(docs[i]):
                assert reqs[i].grammar.accept(docs[i][k])
            else:
                reqs[i].finish_reason = {"type": "stop"}
    print(f"{args.schema} schema, vocab {vocab}, batch {args.batch}, {threads} fill thread(s), {len(fills)} steps (CPU):")
    print(f"  bitmask fill: mean {statistics.mean(fills) * 1e3:.2f} ms/step, max {max(fills) * 1e3:.2f} ms")
    print(f"  mask applied from the packed bitmask (CPU fallback): mean {statistics.mean(applies) * 1e3:.2f} ms/step")


if __name__ == "__main__":
    main()
