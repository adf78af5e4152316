"""What FP8 weights and an FP8 KV cache cost in accuracy, on the CPU reference path.

    python scripts/fp8_accuracy.py [--model-path DIR] [--prompts 20] [--new-tokens 48]

Against the float32 model (default: the built-in tiny random Qwen2), for bf16 weights (the GPU's
default dtype, as a yardstick), FP8 weights (`--quantization fp8`), an FP8 KV cache
(`--kv-cache-dtype fp8_e4m3`, scales 1.0) and both:
  * logit error: max |logit - reference| / max |reference logit| over every position of a
    sequence computed as two extends (the second reads the first's KV back from the pool);
  * top-1 agreement: the fraction of positions of the reference's greedy continuations where the
    variant's argmax (given the reference's tokens so far) is the reference's token;
  * greedy run: tokens each variant generates (greedy, on its own) before its first difference
    from the reference's.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.default_model import ensure_model_path
from radixserve.engine.engine import Engine
from radixserve.model.loader import load_model

VARIANTS = {  # name: (dtype, --quantization, --kv-cache-dtype)
    "bf16 weights": ("bfloat16", None, "auto"),
    "fp8 weights": ("float32", "fp8", "auto"),
    "fp8 KV": ("float32", None, "fp8_e4m3"),
    "fp8 weights + KV": ("float32", "fp8", "fp8_e4m3"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def two_extend_logits(model, cfg, tokens: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """Logits of every position: the first half as one extend, the second over its cached KV."""
    pool = KVPool(len(tokens) + 8, 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype, "cpu",
                  kv_scales=model.kv_cache_scales)
    table = torch.zeros(1, len(tokens) + 1, dtype=torch.int64)
    table[0, :len(tokens)] = torch.arange(1, len(tokens) + 1)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    out = []
    cut = len(tokens) // 2
    for lo, hi in ((0, cut), (cut, len(tokens))):
        n = hi - lo
        batch = ForwardBatch(ForwardMode.EXTEND, t(tokens[lo:hi]), torch.arange(lo, hi), table[0, lo:hi].clone(),
                             t([0]), t([hi]), t([n]), t([lo]), [hi], [n], [lo], table, pool,
                             logits_indices=torch.arange(n))
        out.append(model(batch).float())
    return torch.cat(out)


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    res = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "temperature": 0,
                                                              "ignore_eos": True})
    return [r["output_ids"] for r in res]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    path = ensure_model_path(args.model_path)
    rng = random.Random(args.seed)
    ref_engine = Engine(path, device="cpu", dtype="float32")
    vocab = ref_engine.core.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    ref_out = greedy(ref_engine, prompts, args.new_tokens)
    ref_engine.shutdown()
    seqs = [p + o for p, o in zip(prompts, ref_out)]
    ref_model, cfg = load_model(path, attn_backend=TorchAttentionBackend())
    ref_logits = [two_extend_logits(ref_model, cfg, s, torch.float32) for s in seqs]

    print(f"{len(prompts)} prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens each, {path}")
    print("| variant | logit error, mean / max | top-1 agreement | greedy run, mean / min (of "
          f"{args.new_tokens}) | prompts with all {args.new_tokens} |")
    print("|---|---|---|---|---|")
    for name, (dtype, quant, kv) in VARIANTS.items():
        kv_dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else DTYPES[dtype]
        model, _ = load_model(path, attn_backend=TorchAttentionBackend(), dtype=DTYPES[dtype], quantization=quant)
        errs, hits, total = [], 0, 0
        for s, ref in zip(seqs, ref_logits):
            got = two_extend_logits(model, cfg, s, kv_dtype)
            errs.append(float((got - ref).abs().max() / ref.abs().max()))
            positions = slice(args.prompt_len - 1, len(s) - 1)  # predicting each generated token
            hits += int((got[positions].argmax(-1) == ref[positions].argmax(-1)).sum())
            total += len(s) - args.prompt_len
        engine = Engine(path, device="cpu", dtype=dtype, quantization=quant, kv_cache_dtype=kv)
        runs = []
        for ours, ref in zip(greedy(engine, prompts, args.new_tokens), ref_out):
            runs.append(next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref)))
        engine.shutdown()
        print(f"| {name} | {statistics.mean(errs):.3f} / {max(errs):.3f} | {hits / total:.3f} | "
              f"{statistics.mean(runs):.1f} / {min(runs)} | {sum(r == args.new_tokens for r in runs)} |")


if __name__ == "__main__":
    main()
