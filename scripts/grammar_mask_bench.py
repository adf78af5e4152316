"""Host cost per step of the grammar mask path at a batch of constrained requests (CPU-measurable).

    python scripts/grammar_mask_bench.py --tokenizer-path .qwen2-tokenizer --batch 64

Drives `--batch` matchers of the structured-outputs benchmark's tool schema through valid JSON
documents (staggered, so the rows sit in different states) and times, per step, what the engine
does for a constrained step: xgrammar's batched fill into the persistent bitmask buffer
(`GrammarMask.fill`), and masking the [batch, vocab] logits from the packed bitmask
(`GrammarMask.apply_filled_`: on a GPU the copy and one Triton kernel, timed to completion; on the
CPU the tensor-operation fallback). `--schema unbounded` drops the schema's `maxLength`s (before
0.2.9, xgrammar filled masks inside a `maxLength` string orders of magnitude slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from structured_bench import TOOL_SCHEMA, unbounded  # noqa: E402


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
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mask = GrammarMask(compilers, args.batch, device)
    mask.warm_up()
    logits = torch.randn(args.batch, vocab, device=device)
    fills, applies = [], []
    for step in range(args.steps):
        rows = GrammarMask.constrained_rows(reqs)
        if not rows:
            break
        start = time.perf_counter()
        mask.fill(reqs, rows)
        filled = time.perf_counter()
        mask.apply_filled_(logits, len(rows))
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        fills.append(filled - start)
        applies.append(done - filled)
        for i in rows:
            k = i % 7 + step
            if k < len(docs[i]):
                assert reqs[i].grammar.accept(docs[i][k])
            else:
                reqs[i].finish_reason = {"type": "stop"}
    where = "copy + Triton kernel, synchronized" if device.type == "cuda" else "CPU fallback"
    print(f"{args.schema} schema, vocab {vocab}, batch {args.batch}, {threads} fill thread(s), {len(fills)} steps "
          f"({device.type}):")
    print(f"  bitmask fill (host): mean {statistics.mean(fills) * 1e3:.2f} ms/step, max {max(fills) * 1e3:.2f} ms")
    print(f"  mask applied from the packed bitmask ({where}): mean {statistics.mean(applies) * 1e3:.2f} ms/step")


if __name__ == "__main__":
    main()
