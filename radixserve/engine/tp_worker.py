"""A tensor-parallel rank other than 0: `python -m radixserve.engine.tp_worker` (started by rank 0,
or on another node by that node's launcher, radixserve.engine.tp_node).

It joins the group, builds its shard of the model and of the KV pool exactly as rank 0 does (the
same collectives in the same order), then runs each step rank 0 sends (see
radixserve.engine.tensor_parallel) until told to stop. It exits when rank 0 dies (a parent-death
signal, a parent check while idle, or a collective failing); on another node, when its launcher
dies or rank 0's store stops answering while it is idle. It also exits when it cannot allocate for
a step itself. When rank 0 gives a step up, this rank's collectives of that step fail (rank 0 left
the group) or never complete (NCCL): it follows rank 0's `RejoinGroup` into a new group.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
import traceback
from typing import Callable, Optional

import torch
import zmq

from radixserve.cache.copy_log import replay
from radixserve.cache.factory import make_host_tier, make_storage_replica
from radixserve.cache.host_pool import CopyEngine
from radixserve.cache.storage_shards import Report, StorageReplica
from radixserve.cache.stores.page_files import model_identity
from radixserve.distributed import TensorParallel, destroy, init_tensor_parallel
from radixserve.distributed.group import open_store
from radixserve.engine.core import DTYPES
from radixserve.engine.cpu_affinity import bind_near_gpu, one_host_thread
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.model_stack import load_rank_model, make_kv_memory
from radixserve.engine.storage_reports import ReportOutbox
from radixserve.engine.tensor_parallel import (CopyBatch, RejoinGroup, SharedSampledTokens, StepMessage, control_key,
                                               rank0_settings)
from radixserve.model.config import ModelConfig
from radixserve.process.gc_tuning import FullCollectionGovernor, govern_collections
from radixserve.process.logging_setup import setup_logging
from radixserve.process.spawn import child_arguments, die_with_parent, parent_gone
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

IDLE_POLL_MS = 1000
# After a collective of a step failed, how long to wait for rank 0's order to join a new group
# (rank 0 sends it before leaving the old one); none means rank 0 or another rank is gone.
REJOIN_WAIT_MS = 10_000


class WorkerRank:
    """Rank `tp.rank`'s model, KV shard and runner; `run_step` mirrors rank 0's launch."""

    def __init__(self, settings: ServerSettings, tp: TensorParallel, report: Optional[Callable[[Report], None]] = None):
        device = tp.device
        dtype = DTYPES.get(settings.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        config = ModelConfig.from_dir(settings.model_path)
        context_len = settings.context_length or config.max_position_embeddings
        self.model, _ = load_rank_model(settings, device, dtype, context_len, tp)
        self.kv_pool, self.req_to_token, _ = make_kv_memory(settings, self.model, device, dtype, context_len, tp)
        self.copier, self.storage = self._make_tiers(settings, tp, report)
        sampled = SharedSampledTokens(self.req_to_token.max_requests, device, tp)
        self.runner = ModelRunner(self.model, self.kv_pool, self.req_to_token, device, settings.random_seed,
                                  cuda_graph_max_bs=min(settings.cuda_graph_max_bs, self.req_to_token.max_requests),
                                  disable_cuda_graph=settings.disable_cuda_graph, sampled=sampled)
        self.sampled = sampled
        self.tp = tp
        self.device = device
        # Recorded before each step is queued (CUDA): what a rejoin waits for when that step is abandoned.
        self.before_last_step: Optional[torch.cuda.Event] = None

    def _make_tiers(self, settings: ServerSettings, tp: TensorParallel, report: Optional[Callable[[Report], None]]
                    ) -> tuple[Optional[CopyEngine], Optional[StorageReplica]]:
        """This rank's host tier (its KV shard's bytes and a hybrid's snapshots, rank 0's slot
        numbering; sized as rank 0's by the same factory) and copy engine, which rank 0's copies
        replay into; and its shard of the storage tier (`report`: to rank 0), which rank 0's
        storage orders replay into."""
        host = make_host_tier(settings, self.kv_pool, tp.min_int)
        storage = None
        if report is not None:
            storage = make_storage_replica(settings, self.kv_pool, host, tp.rank, report,
                                           model=model_identity(settings.model_path))
        return (host.copier if host is not None else None), storage

    @torch.inference_mode()
    def run_copies(self, copies: CopyBatch) -> None:
        """Issue rank 0's copies on this rank's shards, then hold this rank's compute stream until
        its own KV loads and host snapshot copies up to the last one rank 0 has seen complete are
        complete. Also before the replay: a snapshot restore among the orders (on the compute
        stream) may read a slot that an earlier message's snapshot load fills."""
        if self.copier is not None:
            self.copier.compute_waits_for(copies.done_seq)
        replay(copies.orders, self.copier, self.kv_pool.snapshots, self.storage)
        if self.copier is not None:
            self.copier.compute_waits_for(copies.done_seq)

    @torch.inference_mode()
    def run_step(self, msg: StepMessage) -> None:
        if self.device.type == "cuda":
            self.before_last_step = torch.cuda.Event()
            self.before_last_step.record()
        if msg.table_writes is not None:
            self.req_to_token.write_tensors(*(torch.frombuffer(a, dtype=torch.int64) for a in msg.table_writes))
        if msg.copies is not None:
            self.run_copies(msg.copies)
        self.runner.run_parts(msg.graph, msg.decode, [p.tolist() for p in msg.parts], msg.resolve)
        if msg.sample_rows:
            self.sampled.receive(msg.sample_rows)

    @torch.inference_mode()
    def rejoin(self, order: RejoinGroup) -> None:
        """Leave the group and join rank 0's new one, once this rank's work that every rank queued
        is done (on NCCL, the abandoned step's own kernels may wait forever: those are aborted)."""
        if self.device.type == "cuda":
            if order.abandoned and self.before_last_step is not None:
                self.before_last_step.synchronize()
            else:
                torch.cuda.synchronize(self.device)
        self.tp.rejoin()
        self.runner.recapture_graphs()

    def close(self) -> None:
        """Finish this rank's storage writes (rank 0's tree, sent at shutdown, among them)."""
        if self.storage is not None:
            self.storage.close()


def serve(rank: WorkerRank, sock: zmq.Socket, parent_pid: int, disconnects: Optional[zmq.Socket] = None,
          gc_governor: Optional[FullCollectionGovernor] = None) -> bool:
    """Run rank 0's messages until told to stop (True) or until rank 0 is gone (False).
    `disconnects`: on another node than rank 0's, the control socket's monitor, which reports the
    TCP connection to rank 0 closing (no parent-death signal reaches across machines)."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if disconnects is not None:
        poller.register(disconnects, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(IDLE_POLL_MS))
        if disconnects is not None and disconnects in ready and sock not in ready:
            logger.warning("tensor-parallel rank: the connection to rank 0 closed (rank 0 is gone); exiting")
            return False
        if not ready:
            if parent_gone(parent_pid):
                logger.warning("tensor-parallel rank: its parent is gone; exiting")
                return False
            if gc_governor is not None:  # idle: a full collection here delays no step of any rank
                gc_governor.maybe_collect(idle=True)
            continue
        msg: Optional[StepMessage | CopyBatch | RejoinGroup] = pickle.loads(sock.recv())
        if msg is None:
            return True
        if isinstance(msg, CopyBatch):
            rank.run_copies(msg)
        elif isinstance(msg, RejoinGroup):
            rank.rejoin(msg)
        else:
            try:
                rank.run_step(msg)
            except torch.OutOfMemoryError:
                raise  # this rank ran short itself: it ends, and the engine with it, as when it dies
            except RuntimeError:  # a collective failed: rank 0 gave the step up and left, or a rank died
                if sock not in dict(poller.poll(REJOIN_WAIT_MS)):
                    raise
                order = pickle.loads(sock.recv())
                if not isinstance(order, RejoinGroup):
                    raise
                logger.warning("tensor-parallel rank %d: rank 0 gave a step up; joining a new group", rank.tp.rank)
                rank.rejoin(order)


def worker_main(settings: ServerSettings, rank: int, store_port: int, control_addr: Optional[str], parent_pid: int,
                store_host: str = "127.0.0.1") -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: rank 0 stops us
    die_with_parent(parent_pid)  # SIGTERM, no handler: it ends a rank at once, even inside a collective
    setup_logging(settings.log_level, settings.log_file, label=f"tp-rank {rank}")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    device = torch.device(settings.resolved_device())
    if device.type == "cuda":
        device = torch.device("cuda", rank % settings.tp_ranks_per_node)  # this node's GPU
        if not settings.disable_cpu_affinity:
            bind_near_gpu(device)
    remote = rank >= settings.tp_ranks_per_node  # on another node than rank 0
    tp = None
    disconnects: Optional[zmq.Socket] = None
    governor: Optional[FullCollectionGovernor] = None
    outbox: Optional[ReportOutbox] = None
    try:
        store = open_store(store_port, world_size=settings.tp_size, is_master=False, host=store_host)
        if remote:  # rank 0's settings rule every rank; its store says where its step messages come from
            settings, differ = rank0_settings(store, settings)
            if differ:
                logger.warning("tensor-parallel rank %d runs with rank 0's settings, not this node's command line's, "
                               "for: %s", rank, ", ".join(differ))
        disconnects = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if remote else None
        sock.connect(control_addr or store.get(control_key(rank)).decode())
        if settings.storage_enabled:
            outbox = ReportOutbox(ctx, store)
        tp = init_tensor_parallel(rank, settings.tp_size, device, store)
        worker = WorkerRank(settings, tp, outbox)
        one_host_thread(device)  # after loading, which may convert weights on the CPU
        # A full collection inside a step would hold every rank at the step's next collective.
        governor = govern_collections(f"tp-rank {rank}")
        served = serve(worker, sock, parent_pid, disconnects, governor)
        if served:
            worker.close()
        return 0 if served else 1
    except Exception:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        return 1
    finally:
        if governor is not None:
            governor.uninstall()
        if disconnects is not None:
            sock.disable_monitor()
            disconnects.close(0)
        sock.close(0)
        if outbox is not None:
            outbox.close()
        ctx.term()
        destroy(tp)


def main(argv: Optional[list[str]] = None) -> int:
    parser = child_arguments("radixserve tensor-parallel rank (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-host", default="127.0.0.1")
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--control-addr", default=None, help="(default: the address rank 0's store advertises)")
    args = parser.parse_args(argv)
    return worker_main(ServerSettings(**args.settings), args.rank, args.store_port, args.control_addr,
                       args.parent_pid, args.store_host)


if __name__ == "__main__":
    sys.exit(main())
