"""Start the cache-aware router: `python -m radixserve.launch_router --worker-urls URL... [flags]`.

Also `radixserve route ...`. `launch_server --dp-size N [--router-policy P]` uses
`run_data_parallel` from here to start N workers (one per GPU when there are enough, else CPU
workers) behind one router with policy P (default cache_aware).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import threading
from typing import Optional

from radixserve.process.spawn import popen_with_settings
from radixserve.process.supervisor import Supervisor
from radixserve.router.settings import RouterSettings
from radixserve.settings import add_settings_arguments, settings_from_args

# How often the --dp-size launcher looks for workers that exited (and restarts them).
WORKER_RESTART_CHECK_S = 1.0
# What the workers get to drain and exit after SIGTERM (more than their default --graceful-shutdown-timeout).
WORKER_STOP_GRACE_S = 40.0


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The router's flags, one per RouterSettings field (radixserve/router/settings.py)."""
    parser = argparse.ArgumentParser(prog=prog, description="radixserve router: cache-aware placement over workers.")
    add_settings_arguments(parser, RouterSettings)
    return parser


def settings_from_argv(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> RouterSettings:
    parser = build_parser(prog)
    settings = settings_from_args(parser.parse_args(argv), RouterSettings)
    try:
        settings.validate()
        from radixserve.http_common.api_keys import load_admin_key, load_key_ring

        load_key_ring(settings.api_key, settings.api_key_file, warn=False)  # a bad key file: one line, now
        load_admin_key(settings.worker_admin_api_key, settings.worker_admin_api_key_file, "--worker-admin-api-key")
        from radixserve.router.workers import normalize_url

        for url in settings.worker_urls:
            normalize_url(url)
    except ValueError as e:
        parser.error(str(e))
    return settings


def run_router(settings: RouterSettings) -> int:
    import importlib.util

    import uvicorn

    from radixserve.http_common.open_files import connection_cap
    from radixserve.http_common.paced_http import PacedHttpProtocol
    from radixserve.process.logging_setup import setup_logging
    from radixserve.router.app import create_router_app

    setup_logging(settings.log_level)  # the servers' format: one escaped line per record
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_router_app(settings)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(app, host=settings.host, port=settings.port, loop=loop, http=PacedHttpProtocol,
                            log_level="warning", access_log=False, timeout_graceful_shutdown=30, lifespan="on",
                            limit_concurrency=connection_cap(settings.max_connections))
    server = uvicorn.Server(config)
    logging.getLogger("radixserve.router").info(
        "router (%s) on http://%s:%d over %d worker(s)", settings.policy, settings.host, settings.port,
        len(settings.worker_urls))
    server.run()
    return 0 if server.started else 1


def main(argv: Optional[list[str]] = None) -> int:
    from radixserve.http_common.listen import ListenAddressError, check_listen_address

    settings = settings_from_argv(argv, prog="radixserve route" if argv is not None else None)
    try:  # a port out of range or in use: one line before anything starts
        check_listen_address(settings.host, settings.port)
    except ListenAddressError as e:
        print(f"router failed: {e}", file=sys.stderr)
        return 1
    try:
        return run_router(settings)
    except KeyboardInterrupt:
        return 130


# ----------------------------------------------------------------------------- data parallel
def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_gpus(index: int, tp_size: int, gpus: int, workers: int) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES of data-parallel worker `index`: its own tp_size GPUs when there are
    enough for every worker, else None (the workers share what is visible)."""
    if gpus < workers * tp_size:
        return None
    return ",".join(str(index * tp_size + r) for r in range(tp_size))


def run_data_parallel(settings, policy: str = "cache_aware") -> int:
    """Start `settings.dp_size` workers on loopback ports and a router on settings.host:port; with
    --tp-size T each worker is a tensor-parallel engine on its own T GPUs (worker i: GPUs i*T..i*T+T-1)."""
    n, tp = settings.dp_size, settings.tp_size
    gpus = 0
    if settings.resolved_device() == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    # Each worker's settings go through a pipe (radixserve.process.spawn), never its command line,
    # which any local user can read: they hold the API keys.
    workers = Supervisor()
    urls = []
    log = logging.getLogger("radixserve")
    stopping = threading.Event()
    for i in range(n):
        port = _free_port("127.0.0.1")
        env = dict(os.environ)
        visible = worker_gpus(i, tp, gpus, n)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        worker = dataclasses.replace(
            settings, host="127.0.0.1", port=port, dp_size=1, dp_rank=i,
            step_trace_file=f"{settings.step_trace_file}.{i}" if settings.step_trace_file else None)
        worker = workers.start(f"dp worker {i}", functools.partial(
            popen_with_settings, [sys.executable, "-m", "radixserve.launch_server"], worker.to_dict(), env=env))
        urls.append(f"http://127.0.0.1:{port}")
        log.info("dp worker %d: pid %d at %s", i, worker.pid, urls[-1])
    # The launcher's --admin-api-key guards the router's admin endpoints too (never --api-key: they are
    # off when both are the same or it is unset); its workers are its own, named at start: trusted.
    from radixserve.http_common.api_keys import load_admin_key, load_key_ring

    admin_key = load_admin_key(settings.admin_api_key, settings.admin_api_key_file)
    user_keys = load_key_ring(settings.api_key, settings.api_key_file, warn=False)
    router_admin = admin_key if admin_key and user_keys.match(admin_key.encode()) is None else None
    router = RouterSettings(worker_urls=tuple(urls), policy=policy, host=settings.host, port=settings.port,
                            api_key=settings.api_key, api_key_file=settings.api_key_file,
                            worker_admin_api_key=settings.admin_api_key,
                            worker_admin_api_key_file=settings.admin_api_key_file, admin_api_key=router_admin,
                            cache_salt_per_api_key=settings.cache_salt_per_api_key,
                            shared_cache_across_keys=settings.shared_cache_across_keys, health_check_interval=2.0,
                            log_level=settings.log_level,
                            max_connections=settings.max_connections)

    def restart_dead_workers() -> None:
        """A worker exits when its engine dies; start it again on its port (the router's health
        checks take it out of rotation meanwhile and bring it back once it answers)."""
        for worker in workers.exits(WORKER_RESTART_CHECK_S, wait=lambda s: not stopping.wait(s)):
            if stopping.is_set():
                return
            log.error("%s; restarting it", worker.death_line())
            worker.restart()

    def stop_workers() -> None:
        stopping.set()
        restarts.join(WORKER_RESTART_CHECK_S * 5)  # a restart under way ends first: its worker is stopped too
        workers.stop(WORKER_STOP_GRACE_S)

    def exit_on_signal(signum, frame) -> None:
        raise SystemExit(0)

    # uvicorn restores this handler and re-raises the signal once it has drained; exiting through
    # it runs the `finally` below, so the workers are stopped too.
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGINT, exit_on_signal)
    restarts = threading.Thread(target=restart_dead_workers, name="dp-worker-restarts", daemon=True)
    restarts.start()
    try:
        return run_router(router)
    finally:
        stop_workers()


if __name__ == "__main__":
    sys.exit(main())
