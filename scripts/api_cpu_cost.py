"""The API process's own CPU time per request when 1,024 requests arrive at once.

    python scripts/api_cpu_cost.py [--repeats 3] [--num-prompts 1024] [--input-len 64] [--shared-prefix]
                                   [--output api_cpu.json]

Starts a CPU server (the built-in tiny model unless --model-path is given) per repeat and sends it
bursts of `--num-prompts` requests with `bench_serving --request-rate inf` (token-id prompts of
`--input-len` ids, 64 by default, random or with --shared-prefix one gsp group; 4 output tokens):
streamed `/generate` and streamed `/v1/completions`; then from this script's own client (bench_serving always streams, and does not count events) non-streamed
`/generate` with 4 tokens and streamed `/generate` with 4 and with 64, counting the events each
stream carried. For each burst it reads the API process's utime + stime (/proc/PID/stat) before
and after, and reports CPU milliseconds per request; the CPU the 64-token streams took over the
4-token ones, divided by the events they carried over them, is the CPU per streamed chunk (the
API merges a request's tokens that arrive together into one event, so chunks are fewer than
tokens). Also counts the API's event-loop stalls over 100 ms that the server logged.

CPU time, unlike the wall-clock stall count, is about the same on a busy machine as on a quiet
one: what other processes do delays this one but does not add to its own CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
DEFAULT_INPUT_LEN = 64
SHORT_OUTPUT, LONG_OUTPUT = 4, 64
# With --shared-prefix, the ids at the end of a prompt that differ from request to request.
UNSHARED_TAIL = 16


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of proc(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_file: Path, model_path: Optional[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), "--log-file", str(log_file)]
    if model_path:
        cmd += ["--model-path", model_path]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_file}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready")


def bench_serving(port: int, backend: str, num_prompts: int, input_len: int, output_len: int,
                  shared_prefix: bool) -> dict:
    if shared_prefix:  # one gsp group, sent as token ids
        dataset = ["--dataset-name", "generated-shared-prefix", "--prompt-ids", "--gsp-num-groups", "1",
                   "--gsp-prompts-per-group", str(num_prompts), "--gsp-question-len", str(UNSHARED_TAIL),
                   "--gsp-system-prompt-len", str(input_len - UNSHARED_TAIL), "--gsp-output-len", str(output_len)]
    else:
        dataset = ["--dataset-name", "random-ids", "--random-input-len", str(input_len),
                   "--random-output-len", str(output_len)]
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
        subprocess.run([sys.executable, "-m", "radixserve.bench_serving", "--backend", backend, "--port", str(port),
                        "--num-prompts", str(num_prompts), *dataset,
                        "--request-rate", "inf", "--disable-tqdm", "--output-file", out.name],
                       cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text().splitlines()[-1])


async def own_burst(port: int, num_prompts: int, vocab: int, input_len: int, output_len: int, stream: bool,
                    shared_prefix: bool) -> dict:
    """num_prompts /generate requests at once: how many were answered in full, and the events
    their streams carried (the final [DONE] not counted)."""
    rng = random.Random(1)
    shared = [rng.randrange(vocab) for _ in range(input_len - UNSHARED_TAIL)] if shared_prefix else []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as client:
        async def one() -> tuple[bool, int]:
            ids = shared + [rng.randrange(vocab) for _ in range(input_len - len(shared))]
            body = {"input_ids": ids, "stream": stream,
                    "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}}
            if not stream:
                return (await client.post("/generate", json=body)).status_code == 200, 0
            events, done = 0, False
            async with client.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        events += 1
            return r.status_code == 200 and done, events
        answers = await asyncio.gather(*(one() for _ in range(num_prompts)))
    return {"completed": sum(ok for ok, _ in answers), "events": sum(n for _, n in answers)}


def stalls(log_file: Path, since: int) -> list[int]:
    text = log_file.read_text(errors="replace")[since:]
    return [int(ms) for ms in re.findall(r"api: event loop stalled for (\d+) ms", text)]


def one_repeat(args, repeat: int) -> dict:
    port = free_port()
    log_file = Path(tempfile.mkdtemp()) / "server.log"
    proc = start_server(port, log_file, args.model_path)
    try:
        vocab = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json().get("vocab_size", 1000)
        n, length, shared = args.num_prompts, args.input_len, args.shared_prefix
        bursts = {
            "generate_stream_4": lambda: bench_serving(port, "sglang", n, length, SHORT_OUTPUT, shared),
            "completions_stream_4": lambda: bench_serving(port, "openai", n, length, SHORT_OUTPUT, shared),
            "generate_plain_4": lambda: asyncio.run(own_burst(port, n, vocab, length, SHORT_OUTPUT, False, shared)),
            "counted_stream_4": lambda: asyncio.run(own_burst(port, n, vocab, length, SHORT_OUTPUT, True, shared)),
            "counted_stream_64": lambda: asyncio.run(own_burst(port, n, vocab, length, LONG_OUTPUT, True, shared)),
        }
        if args.warmup:  # first-time costs (lazy imports, caches) kept out of the figures
            asyncio.run(own_burst(port, args.warmup, vocab, length, SHORT_OUTPUT, True, shared))
        row: dict = {"repeat": repeat}
        for name, run in bursts.items():
            if args.bursts and name not in args.bursts:
                continue
            log_at = log_file.stat().st_size
            before = cpu_seconds(proc.pid)
            result = run()
            used = cpu_seconds(proc.pid) - before
            row[name] = {"cpu_ms_per_request": 1000 * used / args.num_prompts, "cpu_ms": 1000 * used,
                         "completed": result.get("completed"), "events": result.get("events"),
                         "stalls_ms": stalls(log_file, log_at)}
            print(f"repeat {repeat} {name}: {row[name]}", flush=True)
        if "counted_stream_4" in row and "counted_stream_64" in row:
            short, long = row["counted_stream_4"], row["counted_stream_64"]
            row["cpu_ms_per_chunk"] = (long["cpu_ms"] - short["cpu_ms"]) / max(1, long["events"] - short["events"])
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN,
                   help="Prompt length in token ids (default: %(default)s).")
    p.add_argument("--shared-prefix", action="store_true",
                   help=f"Prompts share all but their last {UNSHARED_TAIL} ids (one generated-shared-prefix "
                        "group), so the engine prefills little and a burst of long prompts takes seconds on a "
                        "CPU while the API still takes in every id.")
    p.add_argument("--model-path", default=None, help="Default: the built-in tiny model.")
    p.add_argument("--output", default=None, help="Write the rows as JSON here.")
    p.add_argument("--bursts", default=None, type=lambda v: v.split(","),
                   help="Only these bursts, comma-separated (default: all).")
    p.add_argument("--warmup", type=int, default=0, help="Streamed requests sent before the bursts (default: 0).")
    args = p.parse_args()
    rows = [one_repeat(args, r) for r in range(args.repeats)]
    print("API process CPU ms per request, mean (min, max) over", args.repeats, "repeats:")
    for name in ("generate_stream_4", "completions_stream_4", "generate_plain_4", "counted_stream_4",
                 "counted_stream_64"):
        if name not in rows[0]:
            continue
        print(f"  {name}: {spread([r[name]['cpu_ms_per_request'] for r in rows])}, "
              f"stalls over 100 ms: {[r[name]['stalls_ms'] for r in rows]}")
    if "cpu_ms_per_chunk" in rows[0]:
        print(f"  per streamed chunk: {spread([r['cpu_ms_per_chunk'] for r in rows])} "
              f"(chunks per 64-token stream: {[r['counted_stream_64']['events'] / args.num_prompts for r in rows]})")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
