"""Server, router and worker processes the experiment starts on free ports, and their caches."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from radixserve.process.supervisor import stop_all

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A launch_server (or launch_router) subprocess on a free port; its output (the server's whole
    log: both of its processes write to stderr) goes to one file, `log_path`."""

    def __init__(self, args: list[str], log_path: Path, module: str = "radixserve.launch_server",
                 env: Optional[dict[str, str]] = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.what = "router" if module.endswith("launch_router") else "server"
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.cmd = [sys.executable, "-m", module, *args, "--port", str(self.port)]
        self._out = open(log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    def tail(self, n: int = 2000) -> str:
        self._out.flush()
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.what} exited with code {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=10.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the {self.what} was not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_all([self.proc], timeout_s)
        self._out.close()


def _gpu_ids() -> list[str]:
    """The GPUs a worker may be pinned to (CUDA_VISIBLE_DEVICES entries, else every device)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    except Exception:
        return []


def worker_envs(n: int, device: str) -> list[dict[str, str]]:
    """Per-worker environment: one GPU each when there are enough; on the CPU, cores / n torch threads."""
    if device != "cpu":
        gpus = _gpu_ids()
        if len(gpus) >= n:
            return [{"CUDA_VISIBLE_DEVICES": gpus[i]} for i in range(n)]
        if gpus or device == "cuda":
            print(f"experiment: {len(gpus)} GPU(s) for {n} workers: they share", flush=True)
            return [{} for _ in range(n)]
    if "OMP_NUM_THREADS" in os.environ:
        return [{} for _ in range(n)]
    threads = str(max(1, (os.cpu_count() or 1) // n))
    return [{"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} for _ in range(n)]


def start_workers(n: int, server_args: list[str], device: str, out_dir: Path, timeout_s: float) -> list[Server]:
    """n servers started together (their start-ups overlap); all stopped again if one fails."""
    workers = [Server(server_args, out_dir / f"worker-{i}.log", env=env)
               for i, env in enumerate(worker_envs(n, device))]
    try:
        for w in workers:
            w.wait_ready(timeout_s)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def flush_caches(urls: list[str], timeout_s: float = 60.0) -> None:
    """POST /flush_cache to each worker, retrying while it still has requests (409)."""
    import httpx

    for url in urls:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = httpx.post(url + "/flush_cache", timeout=30.0)
                if r.status_code == 200:
                    break
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot flush the cache of {url}: {why}")
            time.sleep(0.2)
