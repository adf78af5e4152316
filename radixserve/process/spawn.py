"""Starting a child process of this package, and the child's side of it: its arguments and dying
with its parent.

A server has two kinds of child: the engine process (started by the API process) and a
tensor-parallel rank (started by the engine process). Both start the same way, `python -m MODULE
--settings-json ... --parent-pid ...`: the settings travel whole as JSON, so the child runs with
exactly the parent's, and this package goes first on PYTHONPATH, so the child imports the code the
parent runs however it was installed (a checkout, editable, site-packages).

One death policy for every child: SIGTERM when its parent dies (Linux's parent-death signal), and
a parent check in its idle loop where the signal cannot be had. SIGTERM, not SIGKILL: the engine
process turns it into SystemExit to stop its own ranks and remove its socket files; a rank, which
installs no handler, dies of it at once, even inside a collective (a rank left alone would wait on
its collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Any, Optional

PR_SET_PDEATHSIG = 1
DEATH_SIGNAL = signal.SIGTERM
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """`env` (this process's environment by default) with this package's root first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def spawn_child(module: str, settings: dict[str, Any], *args: str,
                env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start `python -m module --settings-json SETTINGS --parent-pid THIS_PID *args`.

    The parent-death signal comes when the *thread* that started the child ends (Linux's rule),
    so call this from a thread that lives as long as the process (the main thread)."""
    cmd = [sys.executable, "-m", module, "--settings-json", json.dumps(settings), "--parent-pid", str(os.getpid()),
           *args]
    return subprocess.Popen(cmd, env=child_env(env), stdin=subprocess.DEVNULL)


def child_arguments(description: str) -> argparse.ArgumentParser:
    """A child's argument parser with the two arguments `spawn_child` passes: `settings` (the
    parsed JSON dict) and `parent_pid`; the child adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--settings-json", dest="settings", type=json.loads, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    return parser


def die_with_parent(parent_pid: int) -> None:
    """Have Linux send DEATH_SIGNAL to this process when its parent dies; when the parent died
    before this call (the signal would never come), send it now. Install any handler first."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, DEATH_SIGNAL)
        except Exception:  # best effort: the child's idle loop checks `parent_gone` too
            pass
    if parent_gone(parent_pid):
        os.kill(os.getpid(), DEATH_SIGNAL)


def parent_gone(parent_pid: int) -> bool:
    """Whether the parent that started us has died (we were handed to another process)."""
    return os.getppid() != parent_pid
