"""Tensor parallelism, rank 0's side: one scheduler, one radix tree, N ranks running every step.

Rank 0 is the engine process itself (the server's engine process, or the offline `Engine`'s own
process). It starts ranks 1..N-1 (`python -m radixserve.engine.tp_worker`), each a process that
holds the model's shard and its shard of the KV pool (its KV heads of every slot; with a host
tier, their host copies too) and nothing else: no scheduler, no tree, no tokenizer.

One scheduling decision per step, made by rank 0 and sent to the others. Rank 0 decides because
its decisions depend on things only one process can see consistently: when each request
arrived and how long it waited (LPM aging, prefix holds), when a grammar finished compiling, an
abort from a client. Ranks deciding "identically" would each need every request at the same
step and the same clock. What rank 0 sends is what the model runner builds anyway: the step's
index lists (the ones packed into one int64 buffer), the req_to_token table writes made since the
last step, the host-tier copies and recurrent-state snapshot copies issued since the last step, and
the request rows that sample. It
goes over a ZMQ socket per rank, not a collective, so an idle rank waits without a collective
timeout running.

Sampling: rank 0 samples from the gathered logits and broadcasts the ids (one collective of
batch x 8 bytes, in stream order); every rank records them as its rows' last tokens, so the next
step's placeholders resolve to the same token everywhere. The sampling state (per-request seeded
generators, penalties, logit bias, grammar matchers) thus lives only on rank 0, and no rank can
disagree on a token.

Across machines (--nnodes N, SGLang's flags): node 0's engine process is still rank 0 and starts
its node's ranks as above; every other node's `launch_server --node-rank K` starts its own ranks
(radixserve.engine.tp_node), which meet rank 0 at its TCP store on --dist-init-addr. Their step
messages go over TCP, one PUSH socket per remote rank that rank 0 binds and advertises in the
store; a remote rank idle between steps checks the store, so it ends when rank 0 is gone.

A step rank 0 cannot allocate for is taken back on every rank (see `TensorParallelRunner.
abandon_step`): rank 0 decides, tells the others (`RejoinGroup`), and every rank leaves the
process group and joins a new one, because the others may be waiting inside that step's
collectives, which cannot be taken back. A rank other than 0 that cannot allocate ends, and the
engine with it, as when it dies: rank 0 holds everything a rank holds plus the sampler's buffers,
so it is the one that runs short first.

A rank that dies takes the engine down: rank 0 watches the processes and exits with a log line
naming the rank (collectives with a dead peer would hang on NCCL); the server's engine-death
path then ends the server. A rank stopped for RANK_STOPPED_LIMIT_S (SIGSTOP) counts as dead too
(it is killed): otherwise every request would hang on its collectives for their 300 s timeout.
The other ranks die with rank 0 (the parent-death signal of `radixserve.process.spawn`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import shutil
import subprocess
import tempfile
import threading
from array import array
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import zmq

from radixserve.cache.copy_log import CopyLog, CopyOrder
from radixserve.cache.host_pool import CopyEngine
from radixserve.cache.kv_pool import ReqToTokenPool, TableWrites
from radixserve.cache.state_snapshots import StateSnapshots
from radixserve.distributed import SingleRank, TensorParallel, check_divisible, destroy, init_tensor_parallel
from radixserve.distributed.group import open_store
from radixserve.engine.model_runner import LaunchedForward, ModelRunner
from radixserve.engine.sampled_tokens import LastSampledTokens
from radixserve.engine.storage_reports import ReportInbox
from radixserve.model.config import ModelConfig
from radixserve.model.moe_config import check_moe_layout
from radixserve.model.quantization import check_block_alignment
from radixserve.process.spawn import spawn_child
from radixserve.process.supervisor import Child, Supervisor, stop_all, wait_all
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

# How often rank 0 looks at its ranks' processes: a dead rank ends the engine within this.
RANK_WATCH_S = 0.2
RANK_DEATH_EXIT_CODE = 1
# A rank stopped this long (SIGSTOP) counts as dead: the engine ends, and its requests are answered.
RANK_STOPPED_LIMIT_S = 3.0
SHUTDOWN_WAIT_S = 5.0
# With a storage tier the ranks write the pages of rank 0's tree at shutdown before they exit.
STORAGE_SHUTDOWN_WAIT_S = 60.0
# A rank that did not exit on its shutdown message: SIGTERM, and SIGKILL after this.
RANK_TERMINATE_GRACE_S = 2.0


def _ints(values) -> array:
    return array("q", values)


@dataclass
class CopyBatch:
    """The prefix cache's copies rank 0 issued since its last message, every kind in issue order
    (cache/copy_log.py), and the last host-tier KV copy rank 0 has seen complete (`done_seq`): a
    rank issues the copies on its own shards, then makes its compute stream wait for its own KV
    copies up to done_seq (docs/tensor_parallel.md says why that is enough). Sent alone when rank 0
    issued copies in a step that launched nothing."""
    orders: list[CopyOrder]
    done_seq: int


@dataclass
class StepMessage:
    """One step, as every rank runs it. `graph`: replay the decode CUDA graph with `parts` (its five
    columns); else run eagerly with `parts` (ModelRunner.batch_parts). `table_writes`: (rows, cols,
    slots) to apply to req_to_token first; `copies`: the prefix cache's copies rank 0 issued since
    its last message (host-tier KV, recurrent-state snapshots), replayed in order before the forward.
    `sample_rows`: request rows whose sampled ids rank 0 broadcasts after the forward."""
    graph: bool
    decode: bool
    resolve: bool
    parts: tuple[array, ...]
    table_writes: Optional[tuple[array, array, array]]
    sample_rows: array
    copies: Optional[CopyBatch] = None


@dataclass
class RejoinGroup:
    """Rank 0 gave a step up: leave the group and join a new one. `abandoned`: the last step
    rank 0 sent is the one given up (wait only for the work queued before it; its own collectives
    may never complete); else every step sent completed on rank 0 and may be waited for whole."""
    abandoned: bool


class RecordingReqToTokenPool(ReqToTokenPool):
    """Rank 0's table: every write is applied here and kept for the next step's message."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str):
        super().__init__(max_requests, max_context, device)
        self.pending: tuple[array, array, array] = (_ints(()), _ints(()), _ints(()))

    def write(self, writes: TableWrites) -> None:
        tensors = writes.tensors()
        self.write_tensors(*tensors)
        for pending, values in zip(self.pending, tensors):
            pending.frombytes(values.numpy().tobytes())

    def take(self) -> Optional[tuple[array, array, array]]:
        if not self.pending[2]:
            return None
        taken, self.pending = self.pending, (_ints(()), _ints(()), _ints(()))
        return taken


class SharedSampledTokens(LastSampledTokens):
    """The last sampled tokens, the same on every rank: rank 0's `record` broadcasts the ids it
    sampled; the other ranks `receive` them."""

    def __init__(self, num_rows: int, device: torch.device, tp: TensorParallel):
        super().__init__(num_rows, device)
        self.tp = tp

    def record(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        ids = self.tp.broadcast_from_first(ids.to(torch.int64).contiguous())  # the dtype the others receive
        super().record(rows, ids)

    def receive(self, rows: array) -> None:
        ids = torch.empty(len(rows), dtype=torch.int64, device=self.ids.device)
        self.tp.broadcast_from_first(ids)
        rows_t = torch.frombuffer(rows, dtype=torch.int64).to(self.ids.device, non_blocking=True)
        super().record(rows_t, ids)


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: sends each step to the other ranks before running it itself.
    `copier`: the host tier's copy engine and `state_copier`: the prefix cache's recurrent-state
    snapshots; both record their copies into one log, which goes to the other ranks with the steps."""

    def __init__(self, *args, send: Callable[[StepMessage | CopyBatch | RejoinGroup], None], tp: TensorParallel,
                 copier: Optional[CopyEngine] = None, state_copier: Optional[StateSnapshots] = None,
                 storage=None, **kwargs):
        self.send = send
        self.tp = tp
        self.copier = copier
        self.copy_log = CopyLog()
        for store in (copier, state_copier, storage):
            if store is not None:
                store.log = self.copy_log
        self.sent_done_seq = 0
        self.announced = False  # the step being launched went to the other ranks
        self.forward_queued = False  # ... and all of its forward pass was queued here too
        self.announced_tokens = 0
        super().__init__(*args, **kwargs)

    def take_copies(self) -> Optional[CopyBatch]:
        """The copies issued since the last message, unless there is none and no copy completed since."""
        done_seq = self.copier.done_seq if self.copier is not None else 0
        if not self.copy_log.orders and done_seq == self.sent_done_seq:
            return None
        self.sent_done_seq = done_seq
        return CopyBatch(self.copy_log.take(), done_seq)

    def send_copies(self) -> None:
        """Send the copies issued in a step that launched nothing (loads started while every request
        waits), so that the other ranks' copies run beside rank 0's rather than after them."""
        copies = self.take_copies()
        if copies is not None:
            self.send(copies)

    def announce(self, sb: ScheduledBatch, graph: bool, decode: bool, parts, resolve: bool) -> None:
        """The step as `run_model` chose it, with the table writes and host-tier copies since the
        last message, to every other rank; they run it with `run_parts`."""
        table = self.req_to_token
        assert isinstance(table, RecordingReqToTokenPool)
        rows = _ints(r.req_pool_idx for r, s in zip(sb.reqs, sb.sample) if s)
        self.send(StepMessage(graph, decode, resolve, tuple(_ints(p) for p in parts), table.take(), rows,
                              self.take_copies()))
        self.announced, self.announced_tokens = True, len(parts[0])

    def launch_forward(self, sb: ScheduledBatch) -> LaunchedForward:
        self.announced = self.forward_queued = False
        forward = super().launch_forward(sb)
        self.forward_queued = True
        return forward

    def abandon_step(self) -> None:
        """Rank 0 could not finish a step (the engine has taken it back): the other ranks may be
        inside its collectives, waiting for rank 0's part of a sum or of the sampled ids, so every
        rank leaves the group and joins a new one, and captures its decode graphs again. The step's
        table writes and copies were applied everywhere; KV it wrote lies in slots taken back.

        Except when the forward failed part-way with its all-reduces small enough for symmetric
        memory: the others then wait in a kernel no abort stops, and the engine ends (RuntimeError)."""
        if self.announced and not self.forward_queued and \
                self.tp.fast_path_may_take(self.announced_tokens * self.model.config.hidden_size):
            raise RuntimeError("a step failed inside its forward pass while the other ranks may wait in a "
                               "symmetric-memory all-reduce, which cannot be abandoned: the engine ends")
        self.send(RejoinGroup(abandoned=self.announced))
        if self.device.type == "cuda":
            # What this rank queued is matched by the others (they were sent the whole step): it ends.
            torch.cuda.synchronize(self.device)
        self.tp.rejoin()
        self.recapture_graphs()


class LoneRank:
    """Rank 0 of a tp_size 1 engine, the degenerate group: no other process, no process group
    (`SingleRank`: every collective the identity), nothing to send or stop. The engine builds and
    runs through it as through `TensorParallelLeader`, so it never asks the tp size."""

    table_cls = ReqToTokenPool
    storage_inbox = None

    def __init__(self, device: torch.device):
        self.device = device
        self.size = 1
        self.tp: TensorParallel = SingleRank(device)

    def make_runner(self, model, kv_pool, table: ReqToTokenPool, seed: int, copier: Optional[CopyEngine],
                    state_copier: Optional[StateSnapshots] = None, storage=None, **kwargs) -> ModelRunner:
        return ModelRunner(model, kv_pool, table, self.device, seed, **kwargs)

    def dead_rank(self, wait_s: float = 2.0) -> Optional[str]:
        return None

    def close(self) -> None:
        pass


def start_ranks(settings: ServerSettings, cfg: ModelConfig, device: torch.device) -> "LoneRank | TensorParallelLeader":
    """Rank 0's group: alone at tp_size 1; else the other ranks' processes, started and joined in
    one group with this process once the model and device are known to split that many ways."""
    tp_size = settings.tp_size
    if tp_size == 1:
        return LoneRank(device)
    check_divisible(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dense_intermediate_size, tp_size)
    if cfg.hybrid is not None and cfg.hybrid.linear_num_k_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the model's {cfg.hybrid.linear_num_k_heads} "
                         "linear-attention key heads")
    check_block_alignment(cfg.quantization, head_dim=cfg.head_dim, num_heads=cfg.num_attention_heads,
                          num_kv_heads=cfg.num_key_value_heads, intermediate_size=cfg.dense_intermediate_size,
                          tp_size=tp_size)
    check_moe_layout(cfg.moe, cfg.quantization, tp_size)
    device = check_tp_devices(tp_size, device, settings.nnodes)
    if settings.tp_all_reduce == "symm-mem" and device.type != "cuda":
        raise ValueError("tp_all_reduce=symm-mem needs CUDA GPUs")
    return TensorParallelLeader(settings, device)


SETTINGS_KEY = "radixserve/tp-settings"
# What may differ between the nodes of one engine: where each machine keeps its files and logs.
PER_NODE_SETTINGS = ("model_path", "tokenizer_path", "chat_template", "log_file", "log_level", "step_trace_file",
                     "disable_cpu_affinity", "node_rank", "host", "port")


def control_key(rank: int) -> str:
    """The store key under which rank 0 advertises a remote rank's step-message address."""
    return f"radixserve/tp-control/{rank}"


def rank0_settings(store, own: ServerSettings) -> tuple[ServerSettings, list[str]]:
    """A remote rank's settings: rank 0's (from its store), with this node's PER_NODE_SETTINGS; and
    the names of the settings this node's command line gave otherwise (they would make the ranks
    disagree on the steps rank 0 sends: a pool size, a CUDA graph's batch sizes)."""
    theirs = json.loads(store.get(SETTINGS_KEY).decode())
    # Rank 0 publishes its settings without the keys; compared as JSON gives them (tuples as lists).
    mine = json.loads(json.dumps(own.without_secrets().to_dict()))
    differ = sorted(k for k, v in theirs.items() if k not in PER_NODE_SETTINGS and mine.get(k) != v)
    theirs.update({k: mine[k] for k in PER_NODE_SETTINGS})
    return ServerSettings(**theirs), differ


def spawn_rank(settings: ServerSettings, rank: int, store_host: str, store_port: int,
               control_addr: Optional[str] = None) -> subprocess.Popen:
    """Start rank `rank`'s process, a child of this one (rank 0, or another node's launcher)."""
    extra = ["--control-addr", control_addr] if control_addr is not None else []
    return spawn_child("radixserve.engine.tp_worker", settings.to_dict(), "--rank", str(rank),
                       "--store-host", store_host, "--store-port", str(store_port), *extra)


class TensorParallelLeader:
    """Rank 0's handle on the other ranks: their processes (this node's), their control sockets, the group."""

    table_cls = RecordingReqToTokenPool  # every table write goes to the other ranks with the next step

    def __init__(self, settings: ServerSettings, device: torch.device,
                 on_rank_death: Optional[Callable[[str], None]] = None):
        self.size = settings.tp_size
        self.local_size = settings.tp_ranks_per_node
        self.device = device
        self.on_rank_death = on_rank_death or _exit_engine
        self.ipc_dir = tempfile.mkdtemp(prefix="radixserve-tp-")
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.local_ranks = Supervisor()  # the processes of this node's other ranks
        self.closed = False
        self._stop_watch = threading.Event()
        # (rank, monitor) per rank on another node: its control socket's disconnect events, which
        # the watch thread alone reads (and closes when it ends).
        self.monitors: list[tuple[int, zmq.Socket]] = []
        self.watcher: Optional[threading.Thread] = None
        # Kept open while the group lives: the group's rendezvous is rank 0's store.
        host, port = settings.dist_init_host_port() if settings.nnodes > 1 else ("127.0.0.1", 0)
        self.store = open_store(port, world_size=self.size, is_master=True, host=host)
        atexit.register(self.close)
        # The storage tier's ranks report their shards' writes and reads to rank 0 (storage_reports.py).
        self.storage_inbox: Optional[ReportInbox] = None
        self.shutdown_wait_s = STORAGE_SHUTDOWN_WAIT_S if settings.storage_enabled else SHUTDOWN_WAIT_S
        try:
            if settings.storage_enabled:
                self.storage_inbox = ReportInbox(self.ctx, self.store, self.ipc_dir,
                                                 host if settings.nnodes > 1 else None)
            for rank in range(1, self.local_size):
                self._spawn(rank, settings, self.store.port)
            if self.local_size < self.size:
                # The store answers anyone who reaches its port: never the keys.
                self.store.set(SETTINGS_KEY, json.dumps(settings.without_secrets().to_dict()))
            for rank in range(self.local_size, self.size):
                self._open_remote(rank, host)
            # Watching from before the group forms: a rank failing while it loads ends the wait.
            self.watcher = threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True)
            self.watcher.start()
            self.tp = init_tensor_parallel(0, self.size, device, self.store)
        except BaseException:
            self.close()
            raise

    def _spawn(self, rank: int, settings: ServerSettings, store_port: int) -> None:
        addr = f"ipc://{os.path.join(self.ipc_dir, f'rank{rank}')}"
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr)
        self.sockets.append(sock)
        proc = spawn_rank(settings, rank, "127.0.0.1", store_port, control_addr=addr)
        self.local_ranks.add(f"tensor-parallel rank {rank}", proc)
        logger.info("tensor-parallel rank %d: pid %d", rank, proc.pid)

    def _open_remote(self, rank: int, host: str) -> None:
        """A rank on another node: its step messages go over TCP, from a port the store advertises."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://*")
        self.monitors.append((rank, sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)))
        self.sockets.append(sock)
        self.store.set(control_key(rank), f"tcp://{host}:{port}")
        logger.info("tensor-parallel rank %d: on another node, step messages on port %d", rank, port)

    def make_runner(self, model, kv_pool, table: ReqToTokenPool, seed: int, copier: Optional[CopyEngine],
                    state_copier: Optional[StateSnapshots] = None, storage=None, **kwargs) -> ModelRunner:
        """Rank 0's runner: sends each step (and `copier`'s host-tier copies, `state_copier`'s snapshot
        copies, `storage`'s storage-tier orders: storage_shards.ShardedStore) to the other ranks."""
        return TensorParallelRunner(model, kv_pool, table, self.device, seed, **kwargs, send=self.send, tp=self.tp,
                                    copier=copier, state_copier=state_copier, storage=storage,
                                    sampled=SharedSampledTokens(table.max_requests, self.device, self.tp))

    def send(self, msg: StepMessage | CopyBatch | RejoinGroup) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self.sockets:
            sock.send(data, copy=False)

    def _wait_watch(self, seconds: float) -> bool:
        """Wait `seconds`; False once the watch is to stop. A rank on another node whose
        connection closed (its node stopped or failed) ends the engine here: rank 0's next step
        would wait for it forever, in the send or in the collective."""
        if not self.monitors:
            return not self._stop_watch.wait(seconds)
        poller = zmq.Poller()
        for _, mon in self.monitors:
            poller.register(mon, zmq.POLLIN)
        ready = dict(poller.poll(int(seconds * 1000)))
        if self._stop_watch.is_set():
            return False
        for rank, mon in self.monitors:
            if mon in ready:
                self.on_rank_death(f"tensor-parallel rank {rank}, on another node, closed its connection (its node "
                                   f"stopped or failed); the other {self.size - 1} rank(s) cannot go on without it")
                return False
        return True

    def _watch(self) -> None:
        try:
            self._watch_ranks()
        finally:
            for _, mon in self.monitors:
                mon.close(0)

    def _watch_ranks(self) -> None:
        # A stopped rank (SIGSTOP, a debugger) is alive but runs no collective: every step would
        # wait on it for the collective timeout (300 s) with the server's /health at 503; the
        # supervisor kills it after RANK_STOPPED_LIMIT_S and it counts as dead.
        for rank in self.local_ranks.exits(RANK_WATCH_S, wait=self._wait_watch, stopped_limit_s=RANK_STOPPED_LIMIT_S):
            if not self._stop_watch.is_set():
                self.on_rank_death(self._death_line(rank))
            return

    def _death_line(self, rank: Child) -> str:
        return f"{rank.death_line()}; the other {self.size - 1} rank(s) cannot go on without it"

    def dead_rank(self, wait_s: float = 2.0) -> Optional[str]:
        """The line saying which rank exited, waiting up to `wait_s` for one to be seen exiting, or
        None. A step's collective fails the moment a killed rank's sockets close, before the watch
        sees the process gone: the engine then reports the rank, not the collective's traceback."""
        rank = self.local_ranks.first_exit(wait_s)
        return self._death_line(rank) if rank is not None else None

    def close(self) -> None:
        """Stop the ranks (a shutdown message, then SIGTERM, then SIGKILL) and leave the group."""
        if self.closed:
            return
        self.closed = True
        self._stop_watch.set()
        for sock in self.sockets:
            try:
                sock.send(pickle.dumps(None), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        # Asked by the shutdown message; what does not exit gets SIGTERM, then SIGKILL.
        left = wait_all(self.local_ranks.procs, self.shutdown_wait_s)
        stop_all(left, RANK_TERMINATE_GRACE_S)
        clean = not left and all(proc.returncode == 0 for proc in self.local_ranks.procs)
        if self.watcher is not None:
            self.watcher.join(RANK_WATCH_S * 5)
        for i, sock in enumerate(self.sockets, start=1):
            if i >= self.local_size and self.watcher is not None and not self.watcher.is_alive():
                sock.disable_monitor()
            # A remote rank's shutdown message must leave before the socket closes: no process of
            # ours to wait for there.
            sock.close(0 if i < self.local_size else int(SHUTDOWN_WAIT_S * 1000))
        if self.storage_inbox is not None:
            self.storage_inbox.close()
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        # Leaving an NCCL group whose peers were killed could wait on their collectives; gloo's is safe.
        if clean or self.device.type != "cuda":
            destroy(getattr(self, "tp", None))



def _exit_engine(reason: str) -> None:
    """A rank is gone: the others would wait on its collectives forever, so the process ends now
    (the server sees its engine exit and ends too, for its supervisor to restart it)."""
    logger.error("%s; the engine exits (code %d)", reason, RANK_DEATH_EXIT_CODE)
    logging.shutdown()
    os._exit(RANK_DEATH_EXIT_CODE)


def check_tp_devices(tp_size: int, device: torch.device, nnodes: int = 1) -> torch.device:
    """Rank 0's device; ValueError when this node has fewer GPUs than its ranks."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    per_node = tp_size // nnodes
    if count < per_node:
        on = f" ({per_node} on each of {nnodes} nodes)" if nnodes > 1 else ""
        raise ValueError(f"tp_size={tp_size} needs {per_node} GPUs here{on}; {count} visible")
    return torch.device("cuda", 0)
