"""A node other than 0 of a tensor-parallel engine over several machines: what
`launch_server --nnodes N --node-rank K --dist-init-addr HOST:PORT` runs for K > 0.

No HTTP server, no scheduler, no tokenizer: it starts this node's tp_size / nnodes ranks
(`radixserve.engine.tp_worker`, global ranks K*n .. K*n+n-1, one GPU each), which meet rank 0 at
its store on HOST:PORT, and watches them. It ends when they do: 0 when rank 0 stopped the engine
(every rank got its shutdown message or lost rank 0), 1 when one of them failed, after stopping
the others (rank 0's next collective then fails and node 0's server ends too). SIGTERM or Ctrl-C
stops the ranks. Start it before or after node 0: the ranks wait for rank 0's store (up to 300 s).
A rank that finds rank 0 gone while idle (its store no longer answers) exits 1, and so does the
node: its supervisor restarts it for the next engine.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import Optional

from radixserve.engine.tensor_parallel import spawn_rank
from radixserve.process.supervisor import Supervisor
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

WATCH_S = 0.2
STOP_WAIT_S = 10.0


def node_ranks(settings: ServerSettings) -> range:
    """The global tensor-parallel ranks this node runs."""
    per_node = settings.tp_ranks_per_node
    return range(settings.node_rank * per_node, (settings.node_rank + 1) * per_node)


def check_node_devices(settings: ServerSettings) -> None:
    """ValueError when this node has fewer GPUs than its ranks."""
    if settings.resolved_device() != "cuda":
        return
    import torch

    count = torch.cuda.device_count()
    if count < settings.tp_ranks_per_node:
        raise ValueError(f"node {settings.node_rank} runs {settings.tp_ranks_per_node} ranks of tp_size="
                         f"{settings.tp_size} over nnodes={settings.nnodes}; {count} GPUs visible")


def run_node(settings: ServerSettings) -> int:
    """Start this node's ranks and wait for them; the exit code (0: the engine ended normally)."""
    if settings.nnodes < 2 or settings.node_rank < 1:
        raise ValueError("run_node runs a node other than 0 of a multi-node engine (nnodes > 1, node_rank > 0)")
    check_node_devices(settings)
    host, port = settings.dist_init_host_port()
    ranks = node_ranks(settings)
    children = Supervisor()
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Optional[FrameType]) -> None:
        stopping.append(signum)

    def until_signal(seconds: float) -> bool:
        if not stopping:
            time.sleep(seconds)  # a signal's handler runs inside; the sleep goes on after it
        return not stopping

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in ranks:
            children.add(f"tensor-parallel rank {rank}", spawn_rank(settings, rank, host, port))
        logger.info("node %d of %d: tensor-parallel ranks %d-%d of %d (pids %s) joining rank 0 at %s:%d",
                    settings.node_rank, settings.nnodes, ranks[0], ranks[-1], settings.tp_size,
                    ", ".join(str(c.pid) for c in children.children), host, port)
        for _ in children.exits(WATCH_S, wait=until_signal):
            failed = [c for c in children.exited() if c.returncode != 0]
            if failed:
                logger.error("node %d: %s; stopping the node's other ranks", settings.node_rank,
                             failed[0].death_line())
                children.stop(STOP_WAIT_S)
                return 1
            if not children.running():
                logger.info("node %d: its ranks ended with the engine", settings.node_rank)
                return 0
        logger.info("node %d: signal %d, stopping its ranks", settings.node_rank, stopping[0])
        children.stop(STOP_WAIT_S)
        return 0
    finally:
        children.stop(STOP_WAIT_S)
        for s, handler in old.items():
            signal.signal(s, handler)
