"""The per-process helpers every server process uses (radixserve/process/): a spawned child gets its
settings (through a pipe, never on its command line) and dies with its parent, and the one tokenizer loader says what is missing.

Real processes: a parent python that spawns a child through `spawn_child`, killed with SIGKILL
(nothing of it runs after), and a child that finds itself orphaned at start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from radixserve.process.spawn import popen_with_settings
from radixserve.process.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 30.0  # generous: only a hang fails, never a slow machine

CHILD = textwrap.dedent("""
    import sys, time
    from radixserve.process.spawn import child_arguments, die_with_parent
    parser = child_arguments("a test child")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    die_with_parent(args.parent_pid)
    with open(args.out, "w") as f:
        f.write(f"{args.settings['word']} {args.parent_pid}")
    time.sleep(600)
""")

PARENT = textwrap.dedent("""
    import sys, time
    from radixserve.process.spawn import spawn_child
    proc = spawn_child("plumbing_child", {"word": "hello"}, "--out", sys.argv[1])
    print(proc.pid, flush=True)
    time.sleep(600)
""")


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "plumbing_child.py").write_text(CHILD)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), str(tmp_path), env.get("PYTHONPATH")) if p)
    return env


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no one reaped is gone too
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_spawned_child_gets_the_settings_and_dies_with_its_parent(tmp_path):
    out = tmp_path / "child.out"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(out)], env=_env(tmp_path), stdout=subprocess.PIPE,
                              text=True)
    try:
        child_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + DEADLINE_S
        while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.read_text() == f"hello {parent.pid}"
        with open(f"/proc/{child_pid}/cmdline", "rb") as f:  # what `ps` shows any local user
            assert b"hello" not in f.read(), "the settings are on the child's command line"
        assert not _gone(child_pid)
        parent.kill()  # SIGKILL: nothing of the parent runs after it
        parent.wait()
        while not _gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child_pid), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_child_whose_parent_died_before_it_looked_exits_at_once(tmp_path):
    """The parent-death signal is not sent for a parent that died before the child asked for it:
    `die_with_parent` sends it itself (here the named parent is not ours)."""
    not_its_parent = os.getpid() + 1  # its parent is this process
    proc = popen_with_settings([sys.executable, "-m", "plumbing_child", "--parent-pid", str(not_its_parent),
                                "--out", str(tmp_path / "x")], {"word": "x"}, env=_env(tmp_path))
    assert proc.wait(DEADLINE_S) == -signal.SIGTERM
    assert not (tmp_path / "x").exists()


def test_the_tokenizer_loader_says_what_is_missing_or_broken(tmp_path):
    assert load_tokenizer(str(tmp_path)) is None  # a model served on token ids only
    with pytest.raises(ValueError, match="no tokenizer in"):
        load_tokenizer(str(tmp_path), required=True)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot load a tokenizer from '{tmp_path}'"):
        load_tokenizer(str(tmp_path))
