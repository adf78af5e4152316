"""Starting a child process of this package, and the child's side of it: its arguments and dying
with its parent.

A server has two kinds of child: the engine process (started by the API process) and a
tensor-parallel rank (started by the engine process). Both start the same way, `python -m MODULE
--settings-fd N --parent-pid ...`: the settings travel whole as JSON, so the child runs with
exactly the parent's, and this package goes first on PYTHONPATH, so the child imports the code the
parent runs however it was installed (a checkout, editable, site-packages).

The JSON goes through a pipe the child inherits as file descriptor N, never on the command line:
any local user can read a process's command line (`ps`, /proc/PID/cmdline), and the settings may
hold secrets (the API keys; the engine's children are given none, `ServerSettings.without_secrets`,
but a `--dp-size` worker needs them). The child reads the pipe to its end once, at start, and
closes it; only processes of the same user (or root) can open another's descriptors.

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
# The flag naming the inherited descriptor a child reads its settings from.
SETTINGS_FD_FLAG = "--settings-fd"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """`env` (this process's environment by default) with this package's root first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def spawn_child(module: str, settings: dict[str, Any], *args: str,
                env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start `python -m module --settings-fd N --parent-pid THIS_PID *args`, the settings readable
    on descriptor N (`popen_with_settings`).

    The parent-death signal comes when the *thread* that started the child ends (Linux's rule),
    so call this from a thread that lives as long as the process (the main thread)."""
    return popen_with_settings([sys.executable, "-m", module, "--parent-pid", str(os.getpid()), *args], settings,
                               env=child_env(env))


def popen_with_settings(cmd: list[str], settings: dict[str, Any], *,
                        env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start `cmd --settings-fd N`, with `settings` as JSON on a pipe the child inherits as N.

    Writes the whole JSON before returning: a settings dict is a few KB, well within a pipe's
    buffer, and a larger one waits for the child to read it at start. A child that died before
    reading it is left to its exit code (what it wrote to stderr says why)."""
    read_fd, write_fd = os.pipe()  # neither end is inherited but through pass_fds (PEP 446)
    try:
        proc = subprocess.Popen([*cmd, SETTINGS_FD_FLAG, str(read_fd)], env=env, stdin=subprocess.DEVNULL,
                                pass_fds=(read_fd,))
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    with os.fdopen(write_fd, "wb") as pipe:
        try:
            pipe.write(json.dumps(settings).encode())
        except BrokenPipeError:
            pass
    return proc


def read_settings_fd(value: str) -> dict[str, Any]:
    """The settings dict `popen_with_settings` wrote on descriptor `value`; reads it to its end and closes it."""
    with os.fdopen(int(value), "rb") as pipe:
        settings = json.loads(pipe.read())
    if not isinstance(settings, dict):
        raise ValueError(f"{SETTINGS_FD_FLAG}: the settings must be a JSON object")
    return settings


def child_arguments(description: str) -> argparse.ArgumentParser:
    """A child's argument parser with the two arguments `spawn_child` passes: `settings` (the
    dict read from `--settings-fd`) and `parent_pid`; the child adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(SETTINGS_FD_FLAG, dest="settings", type=read_settings_fd, required=True,
                        help="A file descriptor to read the settings (a JSON object) from, once.")
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
