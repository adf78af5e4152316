"""Shared fixtures. Sections are owned by different test suites; keep additions in their own section."""

from __future__ import annotations

# ============================================================================ server fixtures
# A real server process on loopback, started the way users start it, over a tiny random Qwen2
# built once per session.

import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_START_TIMEOUT_S = 180.0
SERVER_MODEL_POSITIONS = 4096


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m <module> ...` with a free port; stdout/stderr go to `output_path`."""

    def __init__(self, args: list[str], workdir: Path, *, module: str = "radixserve.launch_server",
                 api_key: Optional[str] = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.output_path = workdir / f"server-{self.port}.out"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._out = open(self.output_path, "wb")
        self.cmd = [sys.executable, "-m", module, *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(self.cmd, cwd=REPO_ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        self._out.flush()
        return self.output_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.output()[-4000:]}")

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def server_info(self) -> dict:
        return httpx.get(f"{self.base_url}/server_info", headers=self.headers, timeout=10.0).json()

    def stop(self, timeout_s: float = 40.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory) -> Path:
    import json

    from radixserve.testing.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("server-tiny-qwen2"))
    # More positions than the oracle model's 512 (RoPE has no learned weights), so a stream can
    # run long enough for a client to walk away from it mid-way.
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = SERVER_MODEL_POSITIONS
    config_path.write_text(json.dumps(config, indent=2))
    return path


def seed_launch_args(model_dir: Path) -> list[str]:
    """The seed article's launch command, as written, with the tiny model's path (the port is added)."""
    return ["--model-path", str(model_dir), "--trust-remote-code", "--max-total-tokens", "32768",
            "--chunk-prefill-size", "1024", "--radix-cache-policy", "fifo", "--schedule-policy", "lpm",
            "--mem-fraction", "0.85", "--log-requests"]


@pytest.fixture(scope="session")
def server_workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="session")
def server(server_model_dir, server_workdir):
    """The seed's command plus a log file, on CPU; shared by the read-mostly server tests."""
    log_file = server_workdir / "server.log"
    proc = ServerProcess([*seed_launch_args(server_model_dir), "--device", "cpu", "--log-file", str(log_file)],
                         server_workdir)
    proc.log_file = log_file
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


# GPU tests share one device across pytest-xdist's workers. A test that measures how much device
# memory is in use (the memory plan's arithmetic) asks for `gpu_alone`: it then runs while no other
# worker's GPU test runs, every other GPU test holding the device shared.
_LOCK_PATH = os.path.join(tempfile.gettempdir(), "radixserve-gpu-tests.lock")


@pytest.fixture(autouse=True)
def _gpu_shared(request) -> Iterator[None]:
    if "gpu" not in Path(str(request.node.fspath)).parent.parts:
        yield
        return
    with open(_LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if "gpu_alone" in request.fixturenames else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def gpu_alone() -> None:
    """Marker fixture: `_gpu_shared` takes the device lock exclusively for this test."""
