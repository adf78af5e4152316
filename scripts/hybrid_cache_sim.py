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
once unmarked (prompts without a ChatML system turn: a client of /v1/completions that sends a
ChatML prompt it rendered itself is marked from its tokens, as the chat API marks it).

Every table also gives what the states cost: snapshots taken per request (of them, checkpoints
taken on the way), admissions resumed from a checkpoint, and the extra rounds of the linear layers'
mixing per step that capturing states inside prompt pieces takes (charged at the 27B's estimated
2.5 ms each in the throughput).

With the host tier each snapshot copied between the tiers takes the 27B's 3.2 ms (151 MiB at ~50
GB/s) of the host tier's copy stream, beside the steps (`scheduler_sim.TimedCopies`): a request
resuming from one waits until it is done; its KV loads finish within a step, after the snapshot
copies queued before them.
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


HEADER = ("| {what} | hit rate, mean (min-max) | total tok/s | {lost} | snapshots taken per request "
          "(checkpoints) | resumed from a checkpoint | capture rounds per step |\n|---|---|---|---|---|---|---|")


def summary(runs: list[dict], requests: int) -> str:
    """A table row's figures: mean (min-max) over the seeds' runs of `requests` requests each."""
    hits = [r["hit_rate"] for r in runs]

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0) for r in runs)

    costs = "- | - | -" if not runs[0].get("snapshot_slots") else (
        f"{mean('snapshots_taken') / requests:.2f} ({mean('checkpoints_taken') / requests:.2f}) | "
        f"{mean('checkpoint_hits'):.0f} | {mean('capture_rounds') / mean('steps'):.2f}")
    return (f"{statistics.mean(hits):.3f} ({min(hits):.3f}-{max(hits):.3f}) | {mean('total_tok_s') / 1000:.1f}k | "
            f"{mean('turns_that_lost_the_previous_prompt'):.0f} | {costs}")


def run_rows(rows: list[tuple[str, dict]], base: dict) -> None:
    for label, overrides in rows:
        runs = []
        for seed in SEEDS:
            cfg = SimConfig(**{**HYBRID_27B, **base, "seed": seed, **overrides})
            sessions = make_sessions(cfg)
            runs.append(simulate(cfg, sessions))
        print(f"| {label} | {summary(runs, sum(map(len, sessions)))} |", flush=True)


def chat_main() -> None:
    for marks in (True, False):
        print(f"\nchat: {'system turns marked (the chat API)' if marks else 'nothing marked (no ChatML system turn)'}\n")
        print(HEADER.format(what="configuration", lost="requests that lost the system prompt"))
        run_rows(CHAT_ROWS, {**CHAT, "system_marks": marks})


def main() -> None:
    if "--chat" in sys.argv[1:]:
        chat_main()
        return
    host_tier = "--host-tier" in sys.argv[1:]
    rows = HOST_ROWS if host_tier else ROWS
    for echo in (False, True):
        print(f"\nhistory: {'replies sent back as generated' if echo else 'the agent dataset (re-rendered)'}\n")
        print(HEADER.format(what="configuration", lost="turns that lost the previous prompt"))
        run_rows(rows, {"echo_replies": echo, "host_ratio": HOST_RATIO if host_tier else 0.0})


if __name__ == "__main__":
    main()
