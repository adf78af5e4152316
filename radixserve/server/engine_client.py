"""The API process's handle on the engine process: spawn, ZMQ plumbing, per-request streams.

Requests go out on a PUSH socket (no high-water mark, so a send never blocks the event loop),
gathered over one event-loop iteration and sent together at its end (`_flush`): each send wakes
ZMQ's I/O thread, and on a busy machine the woken thread can take the event loop's core for
milliseconds, which once per request of a burst added up to a second. Outputs come back on a
PULL socket read by one task that routes them to per-request queues, at most
`OUTPUTS_PER_ITERATION` per event-loop iteration, merging a request's outputs of the steps that
were waiting together (decoded at most `OUTPUTS_DECODED_PER_ITERATION` per iteration). A watchdog
notices when the engine process exits, fails everything that waits on it (HTTP 503) and calls
`on_death`, so the server can exit and be restarted. `drain()` serves a shutdown: new requests and health probes are refused at
once, those in flight get a deadline to finish.

Engine request ids are always made here: a client's `rid` is only a label, so a reused or forged
one can never reach another request's outputs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import zmq
import zmq.asyncio

from radixserve.engine.messages import AbortRequest, GenerateRequest, RequestOutput
from radixserve.engine import messages as m
from radixserve.process.spawn import spawn_child
from radixserve.process.supervisor import Supervisor, exit_description, kill_all, stop_all, wait_all_async
from radixserve.server.liveness import Liveness, judge
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

WATCHDOG_INTERVAL_S = 0.2
# kill_now's grace between SIGTERM and SIGKILL.
ENGINE_TERMINATE_GRACE_S = 3.0
# Engine outputs handed to their requests per event-loop iteration: each wakes a stream that then
# renders and writes an event (~0.1 ms), so the first tokens of a thousand requests, which arrive
# in one message, are handed out over several short iterations instead of one long one.
# More time to exit with a storage tier: the engine writes the cache's pages not on disk yet
# (gigabytes for a large device pool) so that a restart finds them.
STORAGE_SHUTDOWN_S = 60.0
OUTPUTS_PER_ITERATION = 64
# Engine messages (each one step's outputs) read together when they are already waiting: when this
# process falls behind a thousand streams, each request then gets the tokens of several steps as
# one output, one event to render and write, so the further behind it is the fewer events it writes
# and it catches up (on 2 CPU cores it spent ~0.2 ms an event, a streaming H200 makes 40k tokens a
# second on a small model). Not behind, one message is waiting at a time and nothing changes.
MESSAGES_PER_READ = 32
# Engine outputs decoded (and merged) per event-loop iteration while such a backlog is read: each
# costs ~2 us, and 32 messages of a thousand outputs read in one go held the loop 52-64 ms on 2 CPU
# cores. An API behind a small model's thousand streams reads such backlogs (on an H200 host, so
# behind, it logged loop stalls of 102-144 ms).
OUTPUTS_DECODED_PER_ITERATION = 4096
HEALTH_RID_PREFIX = "health-"


class EngineDeadError(RuntimeError):
    """The engine process is not running; the request cannot be served (HTTP 503)."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at --max-queued-requests (HTTP 503 with Retry-After)."""


class EngineRequestError(ValueError):
    """The engine refused a request as invalid (HTTP 400)."""


class ShuttingDownError(EngineDeadError):
    """The server is draining for shutdown: it takes no new request, and the graceful-shutdown
    deadline passed before this one finished (HTTP 503, like an unavailable engine)."""


_CLIENT_GONE = object()  # put in a group's queue when its HTTP client disconnects


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of the same request: tokens of both, the end and the
    counts of the later, the first-token and queue times of the earlier where it has them."""
    return RequestOutput(
        rid=later.rid, new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_logprobs=[*earlier.new_logprobs, *later.new_logprobs],
        input_logprobs=[*earlier.input_logprobs, *later.input_logprobs], finished=later.finished,
        finish_reason=later.finish_reason, prompt_tokens=later.prompt_tokens, cached_tokens=later.cached_tokens,
        completion_tokens=later.completion_tokens,
        ttft=earlier.ttft if earlier.ttft is not None else later.ttft,
        queue_time=earlier.queue_time if earlier.queue_time is not None else later.queue_time)


@dataclass
class RequestGroup:
    """Engine requests answered together (the `n` choices and prompts of one HTTP request)."""

    client: "EngineClient"
    rids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)
    watcher: Optional[asyncio.Task] = None

    def __post_init__(self) -> None:
        self.unfinished = set(self.rids)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def watch_disconnect(self, receive: Callable[[], Awaitable[dict]]) -> None:
        """Until `stop_watching()`: end `outputs()` as soon as the client disconnects, so a caller
        that is gone stops its requests even while nothing is being written to it. One task waits
        in the ASGI receive channel (the body was read already); polling every waiting request
        for a disconnect instead took a quarter of the API process's time with 1,000 requests
        waiting for their first token. The server's event streams keep it watching until they end
        (they never read the channel themselves); stop it before anything else reads the channel:
        two readers would steal each other's messages."""
        async def watch() -> None:
            while (await receive()).get("type") != "http.disconnect":
                pass
            self.queue.put_nowait(_CLIENT_GONE)

        self.watcher = asyncio.ensure_future(watch())

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield outputs until every request finished or the client went away; raise the engine's
        error for any of them.

        Outputs of one request already waiting in the queue are merged into one: when the API
        process falls behind (a thousand streams), each token would otherwise cost its own event
        (detokenization, JSON, a socket write), so it would fall further behind; merged, the
        client gets the same text in fewer, larger pieces."""
        held: Any = None  # taken from the queue while merging, not yet yielded
        try:
            while self.unfinished:
                if held is not None:
                    item, held = held, None
                else:
                    item = await self.queue.get()
                while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
                    following = self.queue.get_nowait()
                    if not isinstance(following, RequestOutput) or following.rid != item.rid:
                        held = following
                        break
                    item = merge_outputs(item, following)
                if item is _CLIENT_GONE:
                    return
                if isinstance(item, BaseException):
                    self.unfinished.discard(getattr(item, "rid", None))
                    raise item
                if item.finished:
                    self.unfinished.discard(item.rid)
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever has not finished and stop routing outputs here. Safe to call twice."""
        self.stop_watching()
        for rid in self.unfinished:
            self.client.abort(rid)
        self.unfinished.clear()
        for rid in self.rids:
            self.client.groups.pop(rid, None)


class EngineClient:
    def __init__(self, settings: ServerSettings, startup_timeout_s: float = 600.0):
        self.settings = settings
        self.startup_timeout_s = startup_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.children = Supervisor()  # the engine process, once spawned
        self.ready: Optional[m.EngineReady] = None
        self.groups: dict[str, RequestGroup] = {}
        self.replies: dict[str, asyncio.Future] = {}
        self.latest_stats: Optional[m.EngineStats] = None
        # The engine's latest heartbeat and time.monotonic() when it arrived (when the engine became
        # ready, before the first): what /health judges the engine by (radixserve.server.liveness).
        self.heartbeat: Optional[m.EngineHeartbeat] = None
        self.heartbeat_at: Optional[float] = None
        self.on_stats: Optional[Callable[[m.EngineStats], None]] = None
        # Radix cache events ([seq, kind, tokens] lists), for the /kv_events stream.
        self.on_kv_events: Optional[Callable[[list], None]] = None
        # Final outputs of requests nobody waits for any more (the engine confirming an abort).
        self.on_untracked_finish: Optional[Callable[[RequestOutput], None]] = None
        self.dead_reason: Optional[str] = None
        # Called once (on the event loop) when the engine process exits while not being stopped.
        self.on_death: Optional[Callable[[str], None]] = None
        self.draining: Optional[str] = None  # why new requests are refused (a shutdown)
        self.ipc_dir: Optional[str] = None
        self._push: Optional[zmq.Socket] = None
        self._pull_sync: Optional[zmq.Socket] = None
        self._pull: Optional[zmq.asyncio.Socket] = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._outbox: list[list[bytes]] = []  # encoded messages for the engine, in order, not yet sent
        self._flush_scheduled = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    @property
    def engine_pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def spawn(self) -> None:
        """Bind the sockets and start the engine process (it loads the model while we go on)."""
        if self.proc is not None:
            return
        self.ipc_dir = tempfile.mkdtemp(prefix="radixserve-ipc-")
        in_addr = f"ipc://{os.path.join(self.ipc_dir, 'to_engine')}"
        out_addr = f"ipc://{os.path.join(self.ipc_dir, 'from_engine')}"
        ctx = zmq.Context.instance()
        # Sends use a plain socket: with no high-water mark they complete at once, and an abort
        # can be sent from a `finally` of a cancelled task without awaiting.
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull_sync = ctx.socket(zmq.PULL)
        self._pull_sync.setsockopt(zmq.RCVHWM, 0)
        self._pull_sync.setsockopt(zmq.LINGER, 0)
        self._pull_sync.bind(out_addr)

        # The engine checks no key: it (and its ranks, and ps) never sees them.
        self.proc = spawn_child("radixserve.engine.engine_process", self.settings.without_secrets().to_dict(),
                                "--in-addr", in_addr, "--out-addr", out_addr)
        self.children.add("engine process", self.proc)
        logger.info("engine process %d starting", self.proc.pid)

    async def start(self) -> m.EngineReady:
        """Spawn the engine if `spawn()` was not called yet and wait until it is ready (at once when
        it is already). RuntimeError with the reason when it does not start."""
        if self.ready is not None:
            return self.ready
        self.spawn()
        # The receiving side is read by the event loop that serves HTTP, so it is wrapped here.
        self._pull = zmq.asyncio.Socket.from_socket(self._pull_sync)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if await self._pull.poll(200):
                msg = m.decode(await self._pull.recv_multipart())
                if isinstance(msg, m.EngineReady):
                    self.ready = msg
                    self.heartbeat_at = time.monotonic()
                    break
                if isinstance(msg, m.EngineFailed):
                    await self._reap(5.0)
                    raise RuntimeError(f"the engine failed to start: {msg.message}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine process exited during startup (code {self.proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start within {self.startup_timeout_s:.0f} s")
        self._tasks = [asyncio.create_task(self._receive_loop(), name="engine-receive"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]
        logger.info("engine process %d ready: kv_pool=%d tokens context=%d device=%s", self.ready.pid,
                    self.ready.pool_size, self.ready.context_len, self.ready.device)
        return self.ready

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to exit, kill it if it does not, and remove the socket files."""
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None and self._push is not None:
            try:
                self._flush()
                self._push.send_multipart(m.encode(m.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self.settings.storage_enabled:
            timeout_s += STORAGE_SHUTDOWN_S  # the storage tier writes the cache's pages before the engine exits
        await self._reap(timeout_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._mark_dead("the server is shutting down")
        self.close_sockets()

    async def _reap(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        # Told to shut down and still there: it is stuck in its exit (waiting for a worker thread,
        # e.g. a grammar compile). SIGTERM would only raise SystemExit inside that wait and print
        # its traceback, so it is killed outright.
        kill_all(await wait_all_async([self.proc], timeout_s))

    def kill_now(self) -> None:
        """Synchronous last resort (also used from atexit): the engine is gone when this returns."""
        if self.proc is not None:
            stop_all([self.proc], ENGINE_TERMINATE_GRACE_S)

    def close_sockets(self) -> None:
        for sock in (self._push, self._pull, self._pull_sync):
            if sock is not None and not sock.closed:
                sock.close(0)
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            if not self._stopping:
                logger.error("engine unavailable: %s", reason)
        err = EngineDeadError(self.dead_reason)
        for group in list(self.groups.values()):
            group.queue.put_nowait(err)
        self.groups.clear()
        for fut in self.replies.values():
            if not fut.done():
                fut.set_exception(err)
        self.replies.clear()

    async def _watchdog(self) -> None:
        async for engine in self.children.exits_async(WATCHDOG_INTERVAL_S):
            reason = f"the engine process {engine.pid} exited ({exit_description(engine.returncode)})"
            self._mark_dead(reason)
            if not self._stopping and self.on_death is not None:
                self.on_death(reason)
            return

    @property
    def requests_in_flight(self) -> int:
        return sum(1 for rid in self.groups if not rid.startswith(HEALTH_RID_PREFIX))

    async def drain(self, timeout_s: float, reason: str = "the server is shutting down") -> int:
        """Refuse new requests, give those in flight `timeout_s` to finish, then fail the rest
        with `ShuttingDownError` (their responses become 503 bodies or stream error events).
        Returns how many were cut."""
        self.draining = reason
        deadline = time.monotonic() + timeout_s
        while self.requests_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        groups = {id(g): g for rid, g in self.groups.items() if not rid.startswith(HEALTH_RID_PREFIX)}
        err = ShuttingDownError(f"{reason}; the request did not finish within the {timeout_s:g} s "
                                "graceful-shutdown timeout")
        for group in groups.values():
            for rid in group.unfinished:
                self.groups.pop(rid, None)
                self.abort(rid)
            group.queue.put_nowait(err)
        if groups:
            logger.warning("shutdown: %d request(s) still running after %g s were cut", len(groups), timeout_s)
        return len(groups)

    async def _receive_loop(self) -> None:
        """Read what the engine sent, the messages already waiting together (up to
        `MESSAGES_PER_READ`), in order, then hand the outputs out to their requests."""
        while True:
            pending: dict[str, RequestOutput] = {}  # per request, its outputs of this read, merged
            parts = await self._pull.recv_multipart()
            read = decoded = 0
            while True:
                read += 1
                decoded += self._take(parts, pending)
                if read >= MESSAGES_PER_READ or not await self._pull.poll(0):
                    break
                if decoded >= OUTPUTS_DECODED_PER_ITERATION:
                    decoded = 0
                    await asyncio.sleep(0)  # a backlog is decoded over several short iterations
                parts = await self._pull.recv_multipart()
            await self._hand_out(pending)

    def _take(self, parts: list[bytes], pending: dict[str, RequestOutput]) -> int:
        """Decode one engine message and act on it: stats, cache events, errors and control replies
        at once (a request's outputs before its error first); outputs merged into `pending` per
        request (`merge_outputs`). Returns how many outputs it held."""
        try:
            msg = m.decode(parts)
        except Exception as e:
            logger.error("dropping undecodable engine message: %s", e)
            return 0
        if isinstance(msg, m.ControlReply):
            fut = self.replies.pop(msg.reply_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return 0
        if isinstance(msg, m.EngineHeartbeat):
            self.heartbeat, self.heartbeat_at = msg, time.monotonic()
            return 0
        if not isinstance(msg, m.OutputBatch):
            return 0
        if msg.stats is not None:
            self.latest_stats = msg.stats
            if self.on_stats is not None:
                self.on_stats(msg.stats)
        if msg.kv_events and self.on_kv_events is not None:
            self.on_kv_events(msg.kv_events)
        for err in msg.errors:
            if err.rid in pending:  # what it produced before the error, first
                self._route(pending.pop(err.rid))
            group = self.groups.pop(err.rid, None)
            if group is not None:
                exc = QueueFullError(err.message) if err.queue_full else EngineRequestError(err.message)
                exc.rid = err.rid
                group.queue.put_nowait(exc)
        for out in msg.outputs:
            earlier = pending.get(out.rid)
            pending[out.rid] = out if earlier is None else merge_outputs(earlier, out)
        return len(msg.outputs)

    async def _hand_out(self, pending: dict[str, RequestOutput]) -> None:
        for i, out in enumerate(pending.values(), 1):
            self._route(out)
            if i % OUTPUTS_PER_ITERATION == 0 and i < len(pending):
                await asyncio.sleep(0)  # the streams woken so far run before the next ones wake

    def _route(self, out: RequestOutput) -> None:
        group = self.groups.get(out.rid)
        if group is not None:
            group.queue.put_nowait(out)
            if out.finished:
                self.groups.pop(out.rid, None)
        elif out.finished and self.on_untracked_finish is not None:
            self.on_untracked_finish(out)

    # ------------------------------------------------------------------ requests
    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.ready is None:
            raise EngineDeadError("the engine is not running")
        if self.draining is not None:
            raise ShuttingDownError(self.draining)

    def _send(self, msg) -> None:
        self._queue(m.encode(msg))

    def _queue(self, frames: list[bytes]) -> None:
        """Send `frames` at the end of this event-loop iteration, after what was queued before."""
        self._outbox.append(frames)
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a synchronous caller): at once
            self._flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, []
        if self._push is None or self._push.closed:
            return  # the engine is gone; whoever waits on it is failed by _mark_dead
        try:
            for frames in m.batched(outbox):
                self._push.send_multipart(frames)
        except zmq.ZMQError as e:
            logger.warning("could not send %d message(s) to the engine: %s", len(outbox), e)

    def submit(self, requests: list[GenerateRequest]) -> RequestGroup:
        """Queue requests in the engine; iterate `group.outputs()` for their tokens."""
        self._check_alive()
        taken = next((r.rid for r in requests if r.rid in self.groups), None)
        if taken is not None or len({r.rid for r in requests}) < len(requests):
            raise EngineRequestError(f"request id {taken!r} is already in use")
        group = RequestGroup(self, [r.rid for r in requests])
        encoded = [m.encode(r) for r in requests]  # raises before anything is queued
        for rid in group.rids:
            self.groups[rid] = group
        for frames in encoded:
            self._queue(frames)
        return group

    def abort(self, rid: str) -> None:
        self.groups.pop(rid, None)
        if self.alive:
            self._send(AbortRequest(rid=rid))

    def liveness(self, stall_timeout_s: float) -> Liveness:
        """Whether the running engine is alive, from its heartbeats alone (nothing is sent to it)."""
        silence = time.monotonic() - self.heartbeat_at if self.heartbeat_at is not None else 0.0
        return judge(self.heartbeat, silence, stall_timeout_s)

    async def probe(self, input_ids: list[int], timeout_s: float) -> float:
        """Generate one token through the engine; returns seconds taken or raises."""
        self._check_alive()
        rid = f"{HEALTH_RID_PREFIX}{uuid.uuid4().hex}"
        group = RequestGroup(self, [rid])
        self.groups[rid] = group
        start = time.perf_counter()
        self._send(m.HealthProbe(rid=rid, input_ids=input_ids))

        async def run() -> None:
            async for out in group.outputs():
                if out.finished and not out.new_token_ids and out.completion_tokens < 1:
                    raise EngineRequestError(f"health probe finished without a token: {out.finish_reason}")

        try:
            await asyncio.wait_for(run(), timeout_s)
        finally:
            group.close()
        return time.perf_counter() - start

    async def control(self, msg, timeout_s: float = 10.0) -> m.ControlReply:
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self.replies[msg.reply_id] = fut
        self._send(msg)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self.replies.pop(msg.reply_id, None)

    async def flush_cache(self) -> m.ControlReply:
        return await self.control(m.FlushCache(reply_id=uuid.uuid4().hex))

    async def kv_snapshot(self) -> dict[str, Any]:
        reply = await self.control(m.GetKvSnapshot(reply_id=uuid.uuid4().hex))
        return reply.data or {}

    async def get_stats(self) -> dict[str, Any]:
        reply = await self.control(m.GetStats(reply_id=uuid.uuid4().hex))
        return reply.data or {}

