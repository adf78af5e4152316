"""The engine process: one loop that reads requests from ZMQ, steps the engine and pushes outputs.

The loop never waits on the API process: while it has work it only drains messages that are
already there (a zero-timeout poll) and steps; when idle it blocks in a poll with a short timeout.
It is started by `EngineClient.spawn` in the API process as `python -m radixserve.engine.engine_process`
(`radixserve.process.spawn`) and exits when told to, when its parent dies, or when a step raises
(the API then answers 503). Beside the loop, a heartbeat thread (`radixserve.engine.heartbeat`)
tells the API process twice a second that the process runs and how long the loop has been in its
current step, which is what `/health` answers from.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import time
import traceback
from typing import Any, Optional

import zmq

from radixserve.cache.page_events import page_events
from radixserve.engine import messages as m
from radixserve.engine.heartbeat import Heartbeat, LoopPulse
from radixserve.engine.messages import AbortRequest, GenerateRequest, RequestOutput
from radixserve.engine.kv_publisher import ZmqKvEventPublisher, make_kv_publisher
from radixserve.engine.step_trace import StepTrace
from radixserve.process.gc_tuning import FullCollectionGovernor, govern_collections
from radixserve.process.logging_setup import setup_logging
from radixserve.process.spawn import child_arguments, die_with_parent, parent_gone
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.prefill import QueueRoom
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

IDLE_POLL_MS = 50
# The cache invariant check reads every slot of the pool (tens of ms at 10M slots): it runs once the
# engine has been idle this long, not at every short gap between requests, where it would delay
# the request that ends the gap.
IDLE_CHECK_S = 1.0
# With work in flight, a stats snapshot rides along with the outputs at least this often.
STATS_INTERVAL_S = 0.5
HIT_RATE_WINDOW_S = 60.0
PARENT_CHECK_S = 1.0
SLOW_STEP_S = 0.25  # a step this long is logged with what can explain it


class HitRateWindow:
    """Prefix hit rate over the last `window_s` seconds, from the cumulative counters."""

    def __init__(self, window_s: float = HIT_RATE_WINDOW_S):
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def update(self, now: float, prompt: int, cached: int) -> float:
        self.samples.append((now, prompt, cached))
        start = now - self.window_s
        # Keep the newest sample at or before the window start as the baseline. Counters do not
        # move while no sample is taken, so an old baseline is still exact.
        while len(self.samples) > 1 and self.samples[1][0] <= start:
            self.samples.popleft()
        t0, prompt0, cached0 = self.samples[0]
        if t0 > start:  # younger than the window: everything since the engine started
            prompt0, cached0 = 0, 0
        d_prompt = prompt - prompt0
        return (cached - cached0) / d_prompt if d_prompt > 0 else 0.0


class SlowStepWatch:
    """Logs a step over `threshold_s` with what can explain it: Triton kernel variants compiled and
    CUDA allocator retries (a failed cudaMalloc frees the cache, synchronizes and tries again) since
    the last slow step or start-up. Either stalls every running request; the counts are read only
    after a slow step, so a fast step costs one comparison."""

    def __init__(self, cuda: bool, threshold_s: float = SLOW_STEP_S):
        self.cuda = cuda
        self.threshold_s = threshold_s
        self.variants = self._variants()
        self.alloc_retries = self._alloc_retries()

    def _variants(self) -> dict[str, int]:
        if not self.cuda:
            return {}
        from radixserve.engine.device_stats import compiled_kernel_variants

        return compiled_kernel_variants()

    def _alloc_retries(self) -> int:
        if not self.cuda:
            return 0
        from radixserve.engine.device_stats import cuda_alloc_retries

        return cuda_alloc_retries()

    def after_step(self, core) -> None:
        info = core.last_step
        if info.seconds < self.threshold_s or info.batch is None:
            return
        variants = self._variants()
        compiled = {k: n - self.variants.get(k, 0) for k, n in variants.items() if n != self.variants.get(k, 0)}
        retries = self._alloc_retries()
        logger.warning("slow step: %.0f ms, %d requests (%s, %d new tokens); kernel variants compiled since the "
                       "last slow step: %s; CUDA allocator retries: +%d", info.seconds * 1000, len(info.batch.reqs),
                       "decode" if info.batch.is_decode_only else "prefill/mixed", info.batch.num_new_tokens,
                       compiled or "none", retries - self.alloc_retries)
        self.variants, self.alloc_retries = variants, retries


class BatchLogger:
    """SGLang-style batch lines; every line ends with the cumulative `prefix_hit_rate`."""

    def __init__(self, log_interval: int):
        self.log_interval = max(1, log_interval)
        self.decode_steps = 0
        self.decode_tokens = 0
        self.decode_since = time.perf_counter()

    def after_step(self, core, stats_fn) -> None:
        info = core.last_step
        batch = info.batch
        if batch is None:
            return
        if not batch.is_decode_only:
            s = stats_fn()
            seconds = max(info.seconds, 1e-9)
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "#running-req: %d, #queue-req: %d, input throughput (token/s): %.1f, prefix_hit_rate: %.3f",
                batch.num_new_seqs, batch.num_new_tokens, batch.num_cached_tokens, s["token_usage"],
                s["running_requests"], s["queued_requests"], batch.num_new_tokens / seconds, s["hit_rate"])
            return
        self.decode_steps += 1
        self.decode_tokens += len(batch.reqs)
        if self.decode_steps % self.log_interval:
            return
        s = stats_fn()
        now = time.perf_counter()
        throughput = self.decode_tokens / max(now - self.decode_since, 1e-9)
        self.decode_tokens, self.decode_since = 0, now
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.1f, "
            "#queue-req: %d, prefix_hit_rate: %.3f",
            s["running_requests"], s["held_by_running_tokens"] + s["protected_tokens"], s["token_usage"],
            throughput, s["queued_requests"], s["hit_rate"])


class EngineLoop:
    def __init__(self, core, settings: ServerSettings, pull: zmq.Socket, push: zmq.Socket, parent_pid: int,
                 gc_governor: Optional[FullCollectionGovernor] = None,
                 kv_publisher: Optional[ZmqKvEventPublisher] = None):
        self.core = core
        self.kv_publisher = kv_publisher  # --kv-events-config: vLLM-format KV events over ZMQ
        self.gc_governor = gc_governor
        self.settings = settings
        self.pull = pull
        self.push = push
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(pull, zmq.POLLIN)
        self.batch_logger = BatchLogger(settings.log_interval)
        # On a GPU a step over 250 ms is an anomaly worth a line; on the CPU it is the norm.
        self.slow_steps = SlowStepWatch(cuda=True) if core.device.type == "cuda" else None
        self.window = HitRateWindow()
        self.step_trace = StepTrace(settings.step_trace_file) if settings.step_trace_file else None
        self.pending_outputs: list[RequestOutput] = []
        self.pending_errors: list[m.RequestError] = []
        self.stats_due = True
        self.last_stats = 0.0
        self.last_parent_check = time.monotonic()
        self.checked_idle = True
        self.idle_since: Optional[float] = None
        self.running = True
        self.steps = 0
        # Read by the heartbeat thread, which the API process's /health listens to.
        self.pulse = LoopPulse()
        # The cache's page events (the recorder the vLLM-format publisher reads too); /kv_events'
        # are recorded only once someone asked for a snapshot (a router subscribed).
        self.kv_events = page_events(core.cache)
        self.pending_kv_events: list[list] = []
        # Room the running batch has for the requests of one drain (None: not measured yet).
        self.queue_room: Optional[QueueRoom] = None

    # ------------------------------------------------------------------ messages
    def drain(self, timeout_ms: int) -> None:
        if not self.poller.poll(timeout_ms):
            return
        self.queue_room = None
        while True:
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for one in m.unbatched(frames):
                try:
                    msg = m.decode(one)
                except Exception as e:  # a bug on the sending side; never fatal here
                    logger.error("engine: dropping undecodable message: %s", e)
                    continue
                self.handle(msg)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateRequest):
            limit = self.settings.max_queued_requests
            if limit is not None:
                if self.queue_room is None:
                    self.queue_room = self.core.queue_room()
                if not self.queue_room.admits(len(msg.input_ids), msg.sampling_params.max_new_tokens,
                                              len(self.core.scheduler.waiting), limit):
                    self.pending_errors.append(m.RequestError(
                        rid=msg.rid, queue_full=True,
                        message=f"the waiting queue is full ({limit} requests beyond what is running); "
                                "retry later"))
                    return
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            out = self.core.abort(msg.rid)
            if out is not None:
                self.pending_outputs.append(out)
                self.stats_due = True
        elif isinstance(msg, m.HealthProbe):
            self._add(GenerateRequest(
                rid=msg.rid, input_ids=msg.input_ids, arrival_time=time.monotonic(),
                sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)))
        elif isinstance(msg, m.FlushCache):
            ok = self.core.flush_cache()
            self.send(m.ControlReply(reply_id=msg.reply_id, ok=ok,
                                     message="" if ok else "requests are running; flush refused"))
            self.stats_due = True
        elif isinstance(msg, m.GetKvSnapshot):
            # Events recorded before the snapshot go out numbered (earlier subscribers need them).
            self.pending_kv_events.extend(self.kv_events.take_hashes())
            self.send(m.ControlReply(reply_id=msg.reply_id, ok=True, data=self.kv_events.snapshot()))
        elif isinstance(msg, m.GetStats):
            self.send(m.ControlReply(reply_id=msg.reply_id, ok=True, data=self.stats()))
        elif isinstance(msg, m.Shutdown):
            self.running = False

    def _add(self, req: GenerateRequest) -> None:
        try:
            self.core.add_request(req)
        except ValueError as e:
            self.pending_errors.append(m.RequestError(rid=req.rid, message=str(e)))

    def send(self, msg) -> None:
        self.push.send_multipart(m.encode(msg))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        s = self.core.stats()
        now = time.monotonic()
        s["hit_rate_window"] = self.window.update(now, s["prompt_tokens"], s["cached_prompt_tokens"])
        s["engine_steps"] = self.steps
        return s

    def flush(self) -> None:
        now = time.monotonic()
        if self.kv_publisher is not None:
            self.kv_publisher.step()
        self.pending_kv_events.extend(self.kv_events.take_hashes())
        if self.core.has_work and now - self.last_stats >= STATS_INTERVAL_S:
            self.stats_due = True
        if not (self.pending_outputs or self.pending_errors or self.stats_due or self.pending_kv_events):
            return
        stats = None
        if self.stats_due:
            stats = m.EngineStats(time=time.time(), values=self.stats())
            self.stats_due = False
            self.last_stats = now
        self.send(m.OutputBatch(outputs=self.pending_outputs, errors=self.pending_errors, stats=stats,
                                kv_events=self.pending_kv_events))
        self.pending_outputs = []
        self.pending_errors = []
        self.pending_kv_events = []

    # ------------------------------------------------------------------ loop
    def parent_alive(self) -> bool:
        now = time.monotonic()
        if now - self.last_parent_check < PARENT_CHECK_S:
            return True
        self.last_parent_check = now
        return not parent_gone(self.parent_pid)

    def run(self) -> None:
        while self.running:
            self.pulse.beat(busy=self.core.has_work)
            if not self.parent_alive():
                logger.warning("engine: the API process is gone; exiting")
                return
            copy_wait_ms = round(self.core.copy_wait_s * 1e3)
            self.drain(copy_wait_ms or (0 if self.core.has_work else IDLE_POLL_MS))
            if self.core.has_work:
                self.checked_idle = False
                self.idle_since = None
                self.pulse.busy = True
                outputs = self.core.step()
                self.steps += 1
                self.pulse.steps = self.steps
                self.batch_logger.after_step(self.core, self.core.stats)
                if self.slow_steps is not None:
                    self.slow_steps.after_step(self.core)
                if self.step_trace is not None:
                    self.step_trace.after_step(self.core)
                if outputs:
                    self.pending_outputs.extend(outputs)
                    if any(o.finished for o in outputs):
                        self.stats_due = True
                if not self.core.has_work:
                    self.stats_due = True
            elif self.core.scheduler.release_expired_holds():
                self.stats_due = True  # the protected prefixes went back to plain cache
            elif not self.checked_idle:
                now = time.monotonic()
                self.idle_since = self.idle_since or now
                if now - self.idle_since >= IDLE_CHECK_S:
                    self.core.check_invariants()
                    self.checked_idle = True
            self.flush()
            if self.gc_governor is not None:
                self.gc_governor.maybe_collect(idle=not self.core.has_work)
        # Shutdown: whatever is left is aborted, so the API side can close its streams.
        for rid in list(self.core.scheduler.reqs):
            out = self.core.abort(rid)
            if out is not None:
                self.pending_outputs.append(out)
        self.stats_due = True
        self.flush()


def _orphan_cleanup(in_addr: str, parent_pid: int) -> None:
    """When the API process died without cleaning up (SIGKILL), remove its socket directory."""
    if not parent_gone(parent_pid):
        return
    ipc_dir = os.path.dirname(in_addr[len("ipc://"):])
    if os.path.basename(ipc_dir).startswith("radixserve-ipc-"):
        import shutil

        shutil.rmtree(ipc_dir, ignore_errors=True)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def engine_main(settings: ServerSettings, in_addr: str, out_addr: str, parent_pid: int) -> int:
    # Ctrl-C in a terminal reaches the whole process group; the API process drains and then
    # stops us, so the engine must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # the parent-death signal too: clean up, then exit
    die_with_parent(parent_pid)
    setup_logging(settings.log_level, settings.log_file)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(out_addr)
    code = 0
    try:
        try:
            from radixserve.engine.core import EngineCore
            from radixserve.engine.cpu_affinity import one_host_thread

            core = EngineCore(settings)
        except Exception as e:
            # A model or setting it cannot run (ValueError, a missing file) says why in its message;
            # anything else is a bug, whose traceback is wanted.
            expected = isinstance(e, (ValueError, FileNotFoundError))
            logger.error("engine failed to start: %s%s", e, "" if expected else "\n" + traceback.format_exc())
            push.send_multipart(m.encode(m.EngineFailed(message=f"{type(e).__name__}: {e}")))
            return 1
        try:
            kv_publisher = make_kv_publisher(settings, core.cache)
        except ValueError as e:  # its port is taken or its address is not ours: a one-line start-up failure
            logger.error("engine failed to start: %s", e)
            push.send_multipart(m.encode(m.EngineFailed(message=str(e))))
            core.shutdown()
            return 1
        push.send_multipart(m.encode(m.EngineReady(
            pid=os.getpid(), model_path=core.model_path, pool_size=core.pool_size, context_len=core.context_len,
            vocab_size=core.model_config.vocab_size, max_running_requests=core.scheduler.max_running,
            device=str(core.device), dtype=str(core.dtype).replace("torch.", ""),
            memory=core.memory_plan.as_dict() if core.memory_plan is not None else None,
            prefix_caching=core.cache.keeps_prefixes, keeps_branch_states=core.cache.states is not None)))
        one_host_thread(core.device)  # after loading, which may convert weights on the CPU
        governor = govern_collections("engine")
        loop = EngineLoop(core, settings, pull, push, parent_pid, gc_governor=governor, kv_publisher=kv_publisher)
        heartbeat = Heartbeat(ctx, out_addr, loop.pulse).start()
        try:
            loop.run()
        except Exception:
            lost_rank = core.ranks.dead_rank()
            if lost_rank is not None:  # the collective failed because a rank died: say that, in one line
                logger.error("%s; the engine exits (code 1)", lost_rank)
            else:
                logger.error("engine loop crashed:\n%s", traceback.format_exc())
            code = 1
        finally:
            heartbeat.stop()  # its socket closes before the context ends
            governor.uninstall()
            if loop.step_trace is not None:  # SIGTERM ends run() with SystemExit
                loop.step_trace.close()
            if kv_publisher is not None:
                kv_publisher.close()
            core.shutdown()
    finally:
        pull.close(0)
        push.close(0 if parent_gone(parent_pid) else None)
        ctx.term()
        _orphan_cleanup(in_addr, parent_pid)
    return code


def main(argv: Optional[list[str]] = None) -> int:
    parser = child_arguments("radixserve engine process (started by the API server)")
    parser.add_argument("--in-addr", required=True)
    parser.add_argument("--out-addr", required=True)
    args = parser.parse_args(argv)
    return engine_main(ServerSettings(**args.settings), args.in_addr, args.out_addr, args.parent_pid)


if __name__ == "__main__":
    exit_code = main()
    # Everything is closed and flushed by now; a grammar compile still running in its thread would
    # otherwise hold the interpreter's exit until it finishes (seconds for a large schema).
    logging.shutdown()
    os._exit(exit_code)
