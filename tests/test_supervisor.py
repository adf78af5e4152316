"""The one supervisor of child processes (radixserve/process/supervisor.py), on real processes:
stopping escalates to SIGKILL within one shared grace period, a watch sees each exit once (a
restarted child again), a child stopped too long is killed and reported, and an event loop watches
the same way."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from radixserve.process.supervisor import Supervisor, exit_description, process_stopped, stop_all, wait_all_async

pytestmark = pytest.mark.timeout(120)

# Says "ready" once its SIGTERM disposition is set, so a test never signals it before.
SLEEPER = ("import signal, sys, time\n"
           "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           "print('ready', flush=True)\n"
           "time.sleep(float(sys.argv[2]))\n"
           "sys.exit(int(sys.argv[3]))\n")


def start_sleeper(sigterm: str = "default", seconds: float = 60.0, code: int = 0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, sigterm, str(seconds), str(code)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_exit_descriptions():
    assert exit_description(0) == "exit code 0"
    assert exit_description(3) == "exit code 3"
    assert exit_description(-9) == "killed by signal 9"


def test_stop_all_terminates_then_kills_within_one_shared_grace_period():
    obeys, ignores, ignores_too = start_sleeper(), start_sleeper("ignore"), start_sleeper("ignore")
    started = time.monotonic()
    stop_all([obeys, ignores, ignores_too], grace_s=1.0)
    took = time.monotonic() - started
    assert obeys.returncode == -signal.SIGTERM
    assert ignores.returncode == ignores_too.returncode == -signal.SIGKILL
    assert 1.0 <= took < 1.9, took  # one grace period for both that ignore SIGTERM, not one each


def test_a_watch_sees_each_exit_once_and_a_restarted_child_again():
    supervisor = Supervisor()
    quick = supervisor.start("quick child", lambda: start_sleeper(seconds=0.2, code=3))
    slow = supervisor.add("slow child", start_sleeper())
    seen = []
    try:
        for child in supervisor.exits(0.05):
            seen.append(child.death_line())
            if len(seen) == 1:
                first_pid = child.pid
                child.restart()  # its new process exits too, and is seen again
            else:
                break
        assert seen == [f"quick child (pid {first_pid}) exited (exit code 3)",
                        f"quick child (pid {quick.pid}) exited (exit code 3)"]
        assert quick.pid != first_pid
        assert [c.name for c in supervisor.running()] == ["slow child"]
        assert [c.name for c in supervisor.exited()] == ["quick child"]
        with pytest.raises(RuntimeError, match="slow child"):
            slow.restart()  # added, not started here: nothing to start it again with
    finally:
        supervisor.stop(grace_s=5.0)
    assert slow.returncode == -signal.SIGTERM


def test_a_watch_ends_when_its_wait_says_so():
    supervisor = Supervisor()
    supervisor.add("sleeper", start_sleeper())
    rounds = []

    def three_rounds(seconds: float) -> bool:
        rounds.append(seconds)
        return len(rounds) < 3

    try:
        assert list(supervisor.exits(0.01, wait=three_rounds)) == []
        assert rounds == [0.01, 0.01, 0.01]
    finally:
        supervisor.stop(grace_s=5.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_stopped_too_long_is_killed_and_reported():
    supervisor = Supervisor()
    child = supervisor.add("stopped child", start_sleeper())
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        seen = next(supervisor.exits(0.05, stopped_limit_s=0.5))
        assert 0.5 <= time.monotonic() - started < 5
        assert seen is child and child.returncode == -signal.SIGKILL
        assert child.death_line() == f"stopped child (pid {child.pid}) has been stopped for 0.5 s (SIGSTOP?); killed it"
    finally:
        supervisor.stop(grace_s=1.0)


def test_first_exit_waits_up_to_its_timeout():
    supervisor = Supervisor()
    supervisor.add("sleeper", start_sleeper())
    try:
        started = time.monotonic()
        assert supervisor.first_exit(0.3) is None
        assert 0.3 <= time.monotonic() - started < 2
        quick = supervisor.add("quick", start_sleeper(seconds=0.1, code=1))
        assert supervisor.first_exit(10.0) is quick
    finally:
        supervisor.stop(grace_s=5.0)


def test_an_event_loop_watches_the_same_way():
    supervisor = Supervisor()
    child = supervisor.add("quick", start_sleeper(seconds=0.2, code=2))

    async def first() -> str:
        async for exited in supervisor.exits_async(0.05):
            return exited.death_line()
        return ""

    assert asyncio.run(first()) == f"quick (pid {child.pid}) exited (exit code 2)"

    sleeper, quick = start_sleeper(), start_sleeper(seconds=0.1)
    try:
        assert asyncio.run(wait_all_async([sleeper, quick], 1.0)) == [sleeper]
        assert quick.returncode == 0
    finally:
        stop_all([sleeper], grace_s=5.0)
