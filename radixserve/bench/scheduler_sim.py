"""Replay a multi-turn agent workload through the real scheduler and radix cache, with no model.

The scheduler, the radix tree, the page allocator and the waiting queue are the engine's own; only
the forward pass is replaced by a step-time model of the Qwen2-7B architecture on an H200
(a fixed cost per step, decode rows, KV read for attention, prompt tokens computed). Sampled
tokens are random ids. Sessions behave as `bench_serving --dataset-name agent` sends them: every
session's first turn at t=0, each later turn after the previous one finished plus an
exponential think time.

Used to see, in seconds on a CPU, what the scheduler and the cache keep under pressure: the hit
rate of each policy and how many later turns lost the previous turn's prompt. Calibrated against
the H200 run it reproduces (commit 53d2aa9's scheduler, LPM: hit 0.698 and 92.9k total
tok/s simulated, 0.691 and 94.0k measured); absolute times are only as good as that model.

    python -m radixserve.bench.scheduler_sim                    # the 7B agent workload, 216,825-token pool
    python -m radixserve.bench.scheduler_sim --policies lpm fcfs --pool 150000
    python -m radixserve.bench.scheduler_sim --policies lpm --host-ratio 4   # with a host tier
    python -m radixserve.bench.scheduler_sim --policies lpm --host-ratio 1 --storage --page-size 16  # and a disk
    python -m radixserve.bench.scheduler_sim --policies lpm --hybrid-27b --host-ratio 4 --host-snapshots 844
    python -m radixserve.bench.scheduler_sim --policies lpm --hybrid-27b --workload chat --systems 128

`--workload chat` replays chat traffic instead: many system prompts (of `--system-len` tokens on
average, half to one and a half times it), each seen by `--visits` single-question requests one
after another (each sent after the one before finished plus a think time), every system prompt's
first request at t=0; the end of each system turn marked as the chat API marks it for a hybrid
model, or as the engine finds it in a ChatML prompt (`--no-system-marks`: prompts without a
system turn, nothing marked).

A hybrid model (`--snapshots N`): its prefix cache is the engine's snapshot cache, N recurrent-state
snapshot slots beside `--max-running` request rows, so a prefix resumes only where a snapshot lies.
`--hybrid-27b` sets the Qwen3.5-27B's shapes on an H200 (its KV per token, step costs and the
default split of its memory between running rows and snapshots); `--echo-replies` sends each
reply back as sampled, as a chat client does, instead of the agent dataset's re-rendered history.
`scripts/hybrid_cache_sim.py` sets both against attention-only models.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import random
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.bench.metrics import LOST_SLACK_TOKENS
from radixserve.bench.oracle import OracleRequest, oracle_hit_rate
from radixserve.cache.factory import build_prefix_cache, make_host_tier, make_storage_tier, snapshot_split
from radixserve.cache.host_pool import SyncCopyEngine
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.cache.prefix_cache import OwnedPrefixCache
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.cache.state_snapshots import StateSnapshots
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.request import Req
from radixserve.scheduler.scheduler import Scheduler
from radixserve.settings import ServerSettings

VOCAB = 150_000


@dataclass
class SimConfig:
    policy: str = "lpm"
    pool: int = 216_825  # KV pool in tokens
    eviction: str = "lru"
    chunk: int = 8192
    max_wait_s: float = ServerSettings.lpm_max_wait_s
    prefix_hold_s: float = ServerSettings.prefix_hold_s
    host_ratio: float = 0.0  # a host tier of this many times the pool (--hicache-ratio); its loads finish in a step
    page_size: int = 1  # --page-size (the storage tier needs 16 or more)
    # A storage tier under the host tier (--storage-dir, on a temporary directory of real files);
    # its reads finish in a step, and are taken when reading disk_gbps beats prefill_us a token.
    storage: bool = False
    disk_gbps: float = 5.0  # an NVMe drive's page-sized reads
    storage_oracle: bool = False  # also print the unlimited oracle's hit rate of the same sessions
    max_running: int = 1024
    sessions: int = 256
    turns: int = 5
    systems: int = 8
    system_len: int = 2048
    user_len: int = 256
    assistant_len: int = 128
    output_len: int = 128
    think_s: float = 0.5
    # A client sending text: its tokenizer reads the previous prompt's last token together with the
    # reply after it, so the next turn's ids differ there (on an H200 every later turn of the agent
    # workload found its previous prompt cached less one token).
    retokenized_boundary: bool = True
    # A chat client that sends the model's replies back: each later turn's history holds the
    # previous turn's prompt and sampled tokens as they were (no fixed reply, no re-tokenized end).
    echo_replies: bool = False
    kv_bytes_per_token: float = 57344  # 7B: 28 layers x 4 KV heads x 128 x (K, V) x 2 bytes
    prefill_us: float = 25.0  # per prompt token computed
    step_ms: float = 4.2  # a step's fixed cost (the weights read once)
    decode_row_us: float = 15.0  # per decoding row
    snapshots: int = 0  # a hybrid model's state snapshot slots (0: an attention-only model)
    host_snapshots: int = 0  # a hybrid's snapshot slots in the host tier (with --host-ratio; --mamba-host-cache-size)
    # One snapshot copied between the tiers, on the host tier's copy stream (`TimedCopies`): it
    # overlaps the steps, and completes (as `poll` sees it) after the copies queued before it.
    snapshot_copy_ms: float = 0.0
    # Each extra round of the linear layers' sequence mixing in a step that captures states inside
    # prompt pieces (one per capture point of the row with the most): launches and a state copy.
    capture_round_ms: float = 0.0
    seed: int = 1
    workload: str = "agent"  # or "chat" (`chat_sessions`)
    visits: int = 4  # chat: requests on each system prompt, one after another
    system_marks: bool = True  # chat: the request marks where its system turn ends (Req.branch_hints)


# The Qwen3.5-27B on an H200 (docs/runs/2026-12-03-hybrid-27b.md): 16 full-attention layers' KV per
# token, prefill ~97 us a token, a decode step of 15.7 ms at batch 1 and 59.9 ms at batch 256; the
# default split beside a 216,825-token pool (70 running rows: 15% of the memory after the weights;
# one snapshot per 1,024 pool tokens). Its first agent run had 236 rows and 58 snapshots: hit 0.641
# measured, 0.633 simulated (seed 1; 0.629 over seeds 1-4) with the snapshot policy it ran.
# A capture round: ~10 launches in each of its 48 Gated DeltaNet layers at ~5 us (host-bound) and a
# 151 MiB device copy per state: estimated 2.5 ms, not measured.
HYBRID_27B = dict(kv_bytes_per_token=65536, prefill_us=97.0, step_ms=15.5, decode_row_us=173.0,
                  max_running=70, snapshots=211, snapshot_copy_ms=3.2,  # 151 MiB at ~50 GB/s
                  capture_round_ms=2.5)


# The snapshot cache's counters a hybrid run reports beside the rest.
SNAPSHOT_FIGURES = ("snapshot_slots", "snapshot_hits", "snapshots_taken", "snapshot_evictions", "host_snapshot_hits",
                    "snapshots_written_back", "snapshots_loaded", "checkpoints_taken", "checkpoint_hits")


@dataclass
class Turn:
    prompt: list[int]
    think_s: float
    # Tokens of the session's previous request that this one could find cached (its prompt less the
    # re-tokenized last token, or the system prompt both carry); 0 for a session's first.
    shared: int = 0
    branch_hints: tuple[int, ...] = ()  # Req.branch_hints


def agent_sessions(cfg: SimConfig) -> list[list[Turn]]:
    """Token-id sessions shaped like the agent dataset (system prompt, then user/assistant turns)."""
    rng = random.Random(cfg.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    systems = [ids(cfg.system_len) for _ in range(cfg.systems)]
    sessions = []
    for _ in range(cfg.sessions):
        history = list(systems[rng.randrange(cfg.systems)])
        turns = []
        for t in range(cfg.turns):
            shared = len(turns[-1].prompt) - 1 if turns else 0  # the previous prompt less its re-tokenized end
            history += ids(cfg.user_len)
            turns.append(Turn(list(history), 0.0 if t == 0 else rng.expovariate(1.0 / cfg.think_s), shared))
            if cfg.retokenized_boundary:
                history[-1] = rng.randrange(VOCAB)
            history += ids(cfg.assistant_len)  # a fixed reply, not the model's output
        sessions.append(turns)
    return sessions


def chat_sessions(cfg: SimConfig) -> list[list[Turn]]:
    """Chat traffic on `cfg.systems` system prompts (lengths drawn from half to one and a half times
    `system_len`): a session per system prompt whose `visits` requests are different users' single
    questions, each sent once the one before finished (plus a think time); all sessions start at
    t=0. With `system_marks` each request marks its system turn's end, as the chat API does."""
    rng = random.Random(cfg.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    sessions = []
    for _ in range(cfg.systems):
        system = ids(rng.randint(cfg.system_len // 2, cfg.system_len * 3 // 2))
        hints = (len(system),) if cfg.system_marks else ()
        sessions.append([Turn(system + ids(cfg.user_len), 0.0 if v == 0 else rng.expovariate(1.0 / cfg.think_s),
                              len(system) if v else 0, hints) for v in range(cfg.visits)])
    return sessions


def make_sessions(cfg: SimConfig) -> list[list[Turn]]:
    """The sessions of cfg.workload."""
    if cfg.workload == "chat":
        return chat_sessions(cfg)
    if cfg.workload != "agent":
        raise ValueError(f"unknown workload {cfg.workload!r}: agent or chat")
    return agent_sessions(cfg)


def capture_rounds(batch: ScheduledBatch) -> int:
    """The extra rounds of the linear layers' mixing a step's state captures take (the most of one row)."""
    per_row: dict[int, int] = {}
    for row, _, _ in batch.state_captures:
        per_row[row] = per_row.get(row, 0) + 1
    return max(per_row.values(), default=0)


def step_seconds(batch: ScheduledBatch, cfg: SimConfig) -> float:
    """A coarse H200 step (the 7B architecture by default): launch floor, decode rows, KV read,
    prompt tokens, the rounds of a hybrid's state captures."""
    decode = sum(1 for n in batch.extend_lens if n == 1)
    context = sum(batch.kv_lens_before)
    rounds = capture_rounds(batch)
    return cfg.step_ms * 1e-3 + cfg.decode_row_us * 1e-6 * decode + context * cfg.kv_bytes_per_token / 4.0e12 + \
        batch.num_new_tokens * cfg.prefill_us * 1e-6 + rounds * cfg.capture_round_ms * 1e-3


class UnreadSlotTable(ReqToTokenPool):
    """The request table of a run without a model: nothing reads the slots, so none is written."""

    def write(self, writes) -> None:
        return None


class TimedCopies(SyncCopyEngine):
    """The host tier's copy engine in a run without a model: the copies run at issue (on the
    simulated pools), but `poll` sees each done only once the modelled copy stream is through with
    it. The stream takes the copies in issue order: a snapshot copy (a hybrid's, between the tiers)
    occupies it for `snapshot_s`; a KV copy takes no time of its own (it finishes within a step)
    but completes after the snapshot copies queued before it. `clock` is the simulated time."""

    def __init__(self, *args, snapshot_s: float):
        super().__init__(*args)
        self.snapshot_s = snapshot_s
        self.clock = lambda: 0.0
        self.free_at = 0.0  # when the copy stream is through with the copies issued so far
        self.busy_s = 0.0  # its time spent copying snapshots

    def _through(self, seconds: float) -> tuple[float, float]:
        start = max(self.free_at, self.clock())
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at, start

    def _write_back(self, dev_slots, host_slots) -> tuple[object, object]:
        super()._write_back(dev_slots, host_slots)
        return self._through(0.0)

    def _load(self, host_slots, dev_slots) -> tuple[object, object]:
        super()._load(host_slots, dev_slots)
        return self._through(0.0)

    def _issue(self, copy, uses) -> tuple[object, object]:
        copy()
        return self._through(self.snapshot_s)

    def _is_done(self, event: object) -> bool:
        return event <= self.clock()  # type: ignore[operator]

    def next_done(self) -> Optional[float]:
        """When the oldest copy not yet seen done completes (None: none is pending)."""
        return self._pending[0][2] if self._pending else None


def build_cache(settings: ServerSettings, cfg: SimConfig) -> OwnedPrefixCache:
    """The server's cache, built by the server's factory, over pools of one float per token and per
    state row and snapshot: only the bookkeeping is simulated (a storage tier's pages are real
    files of those floats; its load decisions use the modelled KV bytes and prefill time)."""
    spec = RecurrentStateSpec(1, (1, 1), (1, 1, 1), torch.float32)
    state = RecurrentStatePool(cfg.max_running, spec, "cpu") if cfg.snapshots > 0 else None
    snapshots = None
    if state is not None:
        slots, _ = snapshot_split(settings, spec, torch.device("cpu"), cfg.pool, 4, planned=False)
        snapshots = StateSnapshots(slots, state)
    kv_pool = KVPool(cfg.pool, 1, 1, 1, 1, torch.float32, "cpu", state=state, snapshots=snapshots)
    host = make_host_tier(settings, kv_pool)
    if host is not None:  # its copies complete on the modelled copy stream's time
        host.copier = TimedCopies(kv_pool, host.pool, snapshot_s=cfg.snapshot_copy_ms * 1e-3)
        if host.snapshots is not None:
            host.snapshots.copier = host.copier
    cache = build_prefix_cache(settings, kv_pool, host, recurrent=state is not None)
    if settings.storage_dir is not None:
        # The decision compares bytes / bandwidth: the sim's 4-byte tokens read at the bandwidth
        # that the modelled KV bytes per token would see.
        make_storage_tier(settings, cache, kv_pool, model="scheduler-sim", flops_per_token=1.0,
                          attention_flops_per_pair=0.0, prefill_flops_per_s=1.0 / (cfg.prefill_us * 1e-6),
                          read_bytes_per_s=cfg.disk_gbps * 1e9 * 4 / cfg.kv_bytes_per_token, synchronous=True)
    return cache


def simulate(cfg: SimConfig, sessions: list[list[Turn]]) -> dict:
    """Run every session to its end; the figures a benchmark client would report, plus lost hits."""
    if cfg.echo_replies:  # the replies are written into the sessions as they come
        sessions = [[dataclasses.replace(turn) for turn in session] for session in sessions]
    with tempfile.TemporaryDirectory(prefix="sim-storage-") as directory:
        settings = ServerSettings(schedule_policy=cfg.policy, radix_eviction_policy=cfg.eviction,
                                  max_total_tokens=cfg.pool, chunked_prefill_size=cfg.chunk,
                                  lpm_max_wait_s=cfg.max_wait_s, prefix_hold_s=cfg.prefix_hold_s, device="cpu",
                                  hicache_ratio=cfg.host_ratio, mamba_cache_size=cfg.snapshots,
                                  mamba_host_cache_size=cfg.host_snapshots, page_size=cfg.page_size,
                                  storage_dir=directory if cfg.storage else None, storage_size=1000.0)
        settings.validate()
        cache = build_cache(settings, cfg)
        try:
            return _run(cfg, sessions, settings, cache)
        finally:
            storage = getattr(cache, "storage", None)
            if storage is not None:
                storage.close()


def _run(cfg: SimConfig, sessions: list[list[Turn]], settings: ServerSettings, cache: OwnedPrefixCache) -> dict:
    rows = UnreadSlotTable(cfg.max_running, 1, "cpu")
    now = [0.0]
    sched = Scheduler(settings, cache, rows, context_len=32768, eos_token_ids=[], clock=lambda: now[0])
    rng = random.Random(cfg.seed + 1)
    arrivals = [(0.0, sid, 0) for sid in range(len(sessions))]
    heapq.heapify(arrivals)
    total = sum(len(s) for s in sessions)
    tokens_served, latencies, lost_turns, lost_tokens, steps, rounds = 0, [], 0, 0, 0, 0
    sent_at: dict[str, float] = {}
    ttfts: list[float] = []
    last_token_at: dict[str, float] = {}
    longest_pause = 0.0  # between two tokens of one request (a retraction shows here)
    copies = cache.copier if isinstance(cache.copier, TimedCopies) else None
    if copies is not None:
        copies.clock = lambda: now[0]
    while len(latencies) < total:
        while arrivals and arrivals[0][0] <= now[0]:
            t, sid, turn = heapq.heappop(arrivals)
            rid = f"{sid}-{turn}"
            params = SamplingParams(max_new_tokens=cfg.output_len, temperature=0.0, ignore_eos=True)
            sched.add_request(Req(rid=rid, origin_input_ids=sessions[sid][turn].prompt, sampling_params=params,
                                  arrival_time=t, arrival_seq=-1, branch_hints=sessions[sid][turn].branch_hints))
            sent_at[rid] = t
        batch = sched.schedule()
        if batch is None:  # idle until the next arrival, or the next copy a waiting request needs
            upcoming = [arrivals[0][0]] if arrivals else []
            if copies is not None and copies.next_done() is not None:
                upcoming.append(copies.next_done())  # later than now: poll took in every copy done
            now[0] = min(upcoming)
            continue
        steps += 1
        rounds += capture_rounds(batch)
        now[0] += step_seconds(batch, cfg)
        for req in sched.process_results(batch, [rng.randrange(VOCAB) for s in batch.sample if s]):
            if req.rid in last_token_at:
                longest_pause = max(longest_pause, now[0] - last_token_at[req.rid])
            else:
                ttfts.append(now[0] - sent_at[req.rid])
            last_token_at[req.rid] = now[0]
            if req.finish_reason is None:
                continue
            latencies.append(now[0] - sent_at[req.rid])
            tokens_served += len(req.origin_input_ids) + len(req.output_ids)
            sid, turn = map(int, req.rid.split("-"))
            if turn > 0:  # what it shares with the previous request could have been found cached
                lost = sessions[sid][turn].shared - req.cached_tokens
                lost_turns += lost > LOST_SLACK_TOKENS
                lost_tokens += max(lost, 0)
            if turn + 1 < len(sessions[sid]):
                if cfg.echo_replies:
                    following = sessions[sid][turn + 1]
                    following.prompt = req.origin_input_ids + req.output_ids + following.prompt[-cfg.user_len:]
                    following.shared = len(req.origin_input_ids) - 1
                heapq.heappush(arrivals, (now[0] + sessions[sid][turn + 1].think_s, sid, turn + 1))
    sched.check_invariants()
    latencies.sort()
    ttfts.sort()
    return {
        "policy": cfg.policy, "prefix_hold_s": cfg.prefix_hold_s, "host_ratio": cfg.host_ratio,
        "hit_rate": round(cache.counters.hit_rate, 4), "host_hit_rate": round(cache.counters.host_hit_rate, 4),
        "seconds": round(now[0], 2), "total_tok_s": round(tokens_served / now[0]),
        "p99_latency_s": round(latencies[int(0.99 * (len(latencies) - 1))], 2),
        "p99_ttft_s": round(ttfts[int(0.99 * (len(ttfts) - 1))], 2), "longest_pause_s": round(longest_pause, 2),
        "turns_that_lost_the_previous_prompt": lost_turns, "lost_tokens": lost_tokens,
        "evicted_tokens": cache.counters.evicted_tokens, "retractions": sched.stats.num_retractions, "steps": steps,
        **({"capture_rounds": rounds} if cfg.snapshots else {}),
        **({"copy_stream_busy_s": round(copies.busy_s, 2)} if copies is not None and cfg.snapshots else {}),
        **({"storage_loaded_tokens": cache.tier_stats()["storage_loaded_tokens"],
            "storage_skipped_loads": cache.tier_stats()["storage_skipped_loads"]} if cfg.storage else {}),
        **({k: v for k, v in cache.snapshot_stats().items() if k in SNAPSHOT_FIGURES} if cfg.snapshots else {}),
    }



def unlimited_oracle(sessions: list[list[Turn]]) -> float:
    """The unlimited cache's hit rate over the sessions' prompts, sent in first-turn-first order
    (bench/oracle.py; the sim's replies are fixed, not the model's, so outputs add nothing)."""
    order = sorted(((t, sid) for sid, s in enumerate(sessions) for t in range(len(s))))
    return oracle_hit_rate([OracleRequest(sessions[sid][t].prompt) for t, sid in order]).hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=["lpm", "fcfs"], help="schedule policies to run in turn")
    parser.add_argument("--hybrid-27b", action="store_true",
                        help="the Qwen3.5-27B's KV, step costs and default split (flags given override them)")
    for f in dataclasses.fields(SimConfig):
        if f.name != "policy":
            kind = dict(action=argparse.BooleanOptionalAction) if isinstance(f.default, bool) else dict(type=type(f.default))
            parser.add_argument("--" + f.name.replace("_", "-"), default=None, help=f"default {f.default}", **kind)
    args = vars(parser.parse_args())
    policies = args.pop("policies")
    base = HYBRID_27B if args.pop("hybrid_27b") else {}
    cfg = SimConfig(**{**base, **{k: v for k, v in args.items() if v is not None}})
    sessions = make_sessions(cfg)
    if cfg.storage_oracle:
        print({"unlimited_oracle_hit_rate": round(unlimited_oracle(sessions), 4)}, flush=True)
    for policy in policies:
        print(simulate(dataclasses.replace(cfg, policy=policy), sessions), flush=True)


if __name__ == "__main__":
    main()
