"""Supervising child processes: naming them, seeing them exit, stopping them.

Every process of a server that starts others does the same three things: the API process with its
engine, the engine with its tensor-parallel ranks, a node launcher with its ranks, the --dp-size
launcher with its workers, the experiment with its servers. They are written once here:

- watch: `Supervisor.exits` (and `exits_async` for an event loop) yields each child once as it is
  seen exited. Children are polled every interval: an exit has no event a caller could wait on
  beside its own (a stop flag, a socket), so the caller's `wait` paces the loop and ends it. On
  request a child stopped (SIGSTOP, a debugger) longer than a limit is killed and yielded too: it
  is alive, but a peer waiting on it would wait forever.
- stop: `stop_all` sends SIGTERM to every child, gives them one grace period together (not one
  each: ten stuck children must not take ten periods), then SIGKILLs and reaps what is left.
  `wait_all` (`wait_all_async`) is the grace alone, for children already asked to exit by a message.
- describe: `exit_description` says how a child ended in the same words in every log line.

How a child is started (its command, its settings) is the caller's: a `Child` is a name, the
`Popen` it runs now and, if it may be started again, the function that starts it.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable, Iterator, Optional

# A grace period never ends before each child got this long to exit: a deadline passed while
# waiting for the first child must not SIGKILL the others unseen.
MIN_WAIT_S = 0.1


def exit_description(code: int) -> str:
    """How a process ended, from its return code: "exit code 1", "killed by signal 9"."""
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def process_stopped(pid: int) -> bool:
    """Whether the process is stopped (state T, or t under a tracer) in /proc (False where unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def wait_all(procs: Iterable[subprocess.Popen], timeout_s: float) -> list[subprocess.Popen]:
    """Wait up to `timeout_s` (together, at least MIN_WAIT_S each) for the processes to exit; those
    still running."""
    deadline = time.monotonic() + timeout_s
    running = []
    for proc in procs:
        try:
            proc.wait(max(MIN_WAIT_S, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running.append(proc)
    return running


async def wait_all_async(procs: Iterable[subprocess.Popen], timeout_s: float,
                         interval_s: float = 0.05) -> list[subprocess.Popen]:
    """`wait_all` for an event loop (polled every interval_s: the loop goes on meanwhile)."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        await asyncio.sleep(interval_s)
    return [proc for proc in procs if proc.poll() is None]


def kill_all(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL the processes and reap them: they are gone when this returns."""
    procs = list(procs)
    for proc in procs:
        proc.kill()  # a no-op on one that has exited
    for proc in procs:
        proc.wait()


def stop_all(procs: Iterable[subprocess.Popen], grace_s: float, signum: int = signal.SIGTERM) -> None:
    """`signum` to every running process, `grace_s` for all of them to exit, then SIGKILL for the
    rest; all reaped when this returns."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    kill_all(wait_all(procs, grace_s))


@dataclass
class Child:
    """A child process under a name ("tensor-parallel rank 1", "dp worker 0")."""

    name: str
    proc: subprocess.Popen
    start: Optional[Callable[[], subprocess.Popen]] = None  # how to start it again; None: never
    killed_because: Optional[str] = None  # why the supervisor killed it (it did not exit by itself)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.poll()

    def restart(self) -> None:
        if self.start is None:
            raise RuntimeError(f"{self.name} was not started by a supervisor that can start it again")
        self.proc = self.start()
        self.killed_because = None

    def death_line(self) -> str:
        """ "NAME (pid PID) exited (exit code 1)", or what the supervisor killed it for."""
        if self.killed_because is not None:
            return f"{self.name} (pid {self.pid}) {self.killed_because}"
        return f"{self.name} (pid {self.pid}) exited ({exit_description(self.proc.returncode)})"


def sleep_and_go_on(seconds: float) -> bool:
    """The default pace of a watch: sleep, then watch on."""
    time.sleep(seconds)
    return True


class _ExitWatch:
    """One watch's memory between its rounds: which processes it has yielded (each once; a restarted
    child runs a new one) and since when each child has been seen stopped."""

    def __init__(self, children: list[Child], stopped_limit_s: Optional[float]) -> None:
        self.children = children
        self.stopped_limit_s = stopped_limit_s
        self.yielded: set[subprocess.Popen] = set()  # kept, not their ids: a pid or id may come again
        self.stopped_since: dict[subprocess.Popen, float] = {}

    def round(self) -> list[Child]:
        """The children seen exited (or killed for being stopped) since the last round."""
        ended = []
        for child in list(self.children):
            proc = child.proc
            if proc in self.yielded:
                continue
            if proc.poll() is None and not self._stopped_too_long(child):
                continue
            self.yielded.add(proc)
            self.stopped_since.pop(proc, None)
            ended.append(child)
        return ended

    def _stopped_too_long(self, child: Child) -> bool:
        """Kills a child stopped for stopped_limit_s (a stopped process takes SIGKILL; nothing else
        would end it) and says so."""
        if self.stopped_limit_s is None:
            return False
        proc = child.proc
        if not process_stopped(proc.pid):
            self.stopped_since.pop(proc, None)
            return False
        since = self.stopped_since.setdefault(proc, time.monotonic())
        if time.monotonic() - since < self.stopped_limit_s:
            return False
        kill_all([proc])
        child.killed_because = f"has been stopped for {self.stopped_limit_s:g} s (SIGSTOP?); killed it"
        return True


class Supervisor:
    """The children a process started and answers for."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, name: str, start: Callable[[], subprocess.Popen]) -> Child:
        """Start a child with `start()`; `Child.restart` starts it again the same way."""
        return self.add(name, start(), start)

    def add(self, name: str, proc: subprocess.Popen, start: Optional[Callable[[], subprocess.Popen]] = None) -> Child:
        """Supervise a child started elsewhere."""
        child = Child(name, proc, start)
        self.children.append(child)
        return child

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [child.proc for child in self.children]

    def running(self) -> list[Child]:
        return [child for child in self.children if child.proc.poll() is None]

    def exited(self) -> list[Child]:
        return [child for child in self.children if child.proc.poll() is not None]

    def exits(self, interval_s: float, wait: Callable[[float], bool] = sleep_and_go_on,
              stopped_limit_s: Optional[float] = None) -> Iterator[Child]:
        """Each child as it is seen exited (one that had exited before counts at once), once for
        each process it runs, until `wait(interval_s)` returns False. With `stopped_limit_s`, a
        child stopped that long is killed and yielded (`Child.death_line` says so)."""
        watch = _ExitWatch(self.children, stopped_limit_s)
        while True:
            yield from watch.round()
            if not wait(interval_s):
                return

    async def exits_async(self, interval_s: float, stopped_limit_s: Optional[float] = None) -> AsyncIterator[Child]:
        """`exits` for an event loop: polls every interval_s until the consumer stops iterating
        (or its task is cancelled)."""
        watch = _ExitWatch(self.children, stopped_limit_s)
        while True:
            for child in watch.round():
                yield child
            await asyncio.sleep(interval_s)

    def first_exit(self, timeout_s: float, interval_s: float = 0.02) -> Optional[Child]:
        """A child that has exited, waiting up to `timeout_s` for one; None if none did."""
        deadline = time.monotonic() + timeout_s

        def before_deadline(seconds: float) -> bool:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(seconds, left))
            return True

        return next(self.exits(interval_s, wait=before_deadline), None)

    def stop(self, grace_s: float) -> None:
        """SIGTERM to every child, `grace_s` for all of them, then SIGKILL (see `stop_all`)."""
        stop_all(self.procs, grace_s)
