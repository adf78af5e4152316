"""The hybrid prefix cache against an attention-only model's, in the scheduler simulator.

Each row runs the agent workload (256 sessions x 5 turns, 8 system prompts of 2,048 tokens, all at
once) through the real scheduler, radix tree and snapshot cache with the Qwen3.5-27B's step costs
on an H200 (`radixserve.bench.scheduler_sim`), for seeds 1-4, once as the agent dataset sends its
history (replies re-rendered, the prompt's last token re-tokenized) and once as a chat client that
sends the sampled replies back. Prints a markdown table: mean hit rate (min-max), total tok/s and
the later turns that lost their previous prompt.

    python scripts/hybrid_cache_sim.py              # no host tier
    python scripts/hybrid_cache_sim.py --host-tier  # a host tier of 4x the pool (--hicache-ratio 4)
    python scripts/hybrid_cache_sim.py --chat       # chat traffic instead (below)

`--chat` runs chat traffic (`scheduler_sim.chat_sessions`): 96 system prompts of 1,024-3,072
tokens, each seen by 4 single-question requests (128 tokens) one after another, every system
prompt's first request at t=0; once with the system turn's end marked as the chat API marks it,
once unmarked (a /v1/completions client). Its table adds the snapshots taken per request.

With the host tier each snapshot copied between the tiers costs the 27B's 3.2 ms (151 MiB at ~50
GB/s, on the compute stream); its KV loads finish within a step.
"""

from __future__ import annotations

import statistics
import sys

from radixserve.bench.scheduler_sim import HYBRID_27B, SimConfig, make_sessions, simulate

SEEDS = (1, 2, 3, 4)
ATTENTION_TWIN_TOKENS = 178_000  # an all-attention 27B's tokens in the hybrid's KV + snapshot bytes
ROWS = [
    ("attention-only, 216,825 tokens, 70 rows", dict(snapshots=0, max_running=70)),
    ("attention-only, 216,825 tokens, 1,024 rows", dict(snapshots=0, max_running=1024)),
    ("attention-only 27B twin, the hybrid's bytes (178,000 tokens), 70 rows",
     dict(snapshots=0, max_running=70, pool=ATTENTION_TWIN_TOKENS)),
    ("hybrid, 236 rows + 58 snapshots (the split before)", dict(max_running=236, snapshots=58)),
    ("hybrid, 70 rows + 211 snapshots (the default split)", dict(max_running=70, snapshots=211)),
    ("hybrid, 32 rows + 262 snapshots", dict(max_running=32, snapshots=262)),
]


# --hicache-ratio 4 beside the 216,825-token pool. The hybrid's host snapshots are the engine's
# default (`host_snapshot_slots`): 4x the device's 211, capped at the tier's KV bytes (867,300 tokens
# of 65,536 bytes over 153.9 MB a snapshot: 369).
HOST_RATIO = 4.0
HOST_ROWS = [
    ("attention-only, 216,825 tokens, 70 rows, host tier 4x", dict(snapshots=0, max_running=70)),
    ("hybrid, 70 rows + 211 snapshots, host tier 4x + 369 host snapshots (the default)",
     dict(max_running=70, snapshots=211, host_snapshots=369)),
]


# Chat traffic (`--chat`): many system prompts, each seen a few times in a row.
CHAT = dict(workload="chat", systems=96, visits=4, user_len=128)
CHAT_ROWS = [
    ("attention-only, 216,825 tokens, 70 rows", dict(snapshots=0, max_running=70)),
    ("hybrid, 70 rows + 211 snapshots (the default split)", dict(max_running=70, snapshots=211)),
]


def summary(runs: list[dict]) -> str:
    hits = [r["hit_rate"] for r in runs]
    lost = statistics.mean(r["turns_that_lost_the_previous_prompt"] for r in runs)
    return (f"{statistics.mean(hits):.3f} ({min(hits):.3f}-{max(hits):.3f}) | "
            f"{statistics.mean(r['total_tok_s'] for r in runs) / 1000:.1f}k | {lost:.0f}")


def chat_main() -> None:
    for marks in (True, False):
        print(f"\nchat: {'system turns marked (the chat API)' if marks else 'nothing marked (/v1/completions)'}\n")
        print("| configuration | hit rate, mean (min-max) | total tok/s | requests that lost the system prompt "
              "| snapshots taken per request |")
        print("|---|---|---|---|---|")
        for label, overrides in CHAT_ROWS:
            runs = []
            for seed in SEEDS:
                cfg = SimConfig(**{**HYBRID_27B, **CHAT, "seed": seed, "system_marks": marks, **overrides})
                runs.append(simulate(cfg, make_sessions(cfg)))
            taken = statistics.mean(r.get("snapshots_taken", 0) for r in runs) / (CHAT["systems"] * CHAT["visits"])
            print(f"| {label} | {summary(runs)} | {taken:.2f} |", flush=True)


def main() -> None:
    if "--chat" in sys.argv[1:]:
        chat_main()
        return
    host_tier = "--host-tier" in sys.argv[1:]
    rows = HOST_ROWS if host_tier else ROWS
    for echo in (False, True):
        print(f"\nhistory: {'replies sent back as generated' if echo else 'the agent dataset (re-rendered)'}\n")
        print("| configuration | hit rate, mean (min-max) | total tok/s | turns that lost the previous prompt |")
        print("|---|---|---|---|")
        for label, overrides in rows:
            runs = []
            for seed in SEEDS:
                cfg = SimConfig(**{**HYBRID_27B, "seed": seed, "echo_replies": echo,
                                   "host_ratio": HOST_RATIO if host_tier else 0.0, **overrides})
                runs.append(simulate(cfg, make_sessions(cfg)))
            print(f"| {label} | {summary(runs)} |", flush=True)


if __name__ == "__main__":
    main()
