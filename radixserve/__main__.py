"""`python -m radixserve`: the offline engine on the built-in tiny random Qwen2 (CPU), with cache counts.

Two rounds of chat-style prompts share a system prompt; the second round finds it in the radix
cache, and the printed counters show how many prompt tokens were reused.
"""

from __future__ import annotations

import argparse
import time

from radixserve.engine.engine import Engine

SYSTEM = ("You are a careful assistant for a travel agency. Answer in short sentences, name the city and "
          "the season, and never invent prices. Keep a friendly tone and ask one follow-up question.")
QUESTIONS = ["Where should I go in spring?", "What is good to see in winter?", "Plan a weekend by the sea.",
             "Which city has the best food?"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in tiny random Qwen2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    engine = Engine(args.model_path, device=args.device, max_total_tokens=16384)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    for round_no in (1, 2):
        start = time.perf_counter()
        results = engine.generate(prompt=prompts, sampling_params=params)
        took = time.perf_counter() - start
        print(f"--- round {round_no} ({took * 1000:.0f} ms)")
        for q, r in zip(QUESTIONS, results):
            m = r["meta_info"]
            print(f"{q!r:40} prompt={m['prompt_tokens']:3d} cached={m['cached_tokens']:3d} "
                  f"-> {r['text'][:40]!r}")
    s = engine.cache_stats()
    print("(random weights: the text is noise; the cache counts are the point)")
    print(f"prefix cache: {s['cached_prompt_tokens']} of {s['prompt_tokens']} prompt tokens reused "
          f"(hit rate {s['hit_rate']:.3f}), {s['inserted_tokens']} tokens inserted, {s['evicted_tokens']} evicted, "
          f"{s['tree_nodes']} tree nodes")
    engine.check_invariants()


if __name__ == "__main__":
    main()
