"""Start the HTTP server: `python -m radixserve.launch_server --model-path ... --port 8000`.

Every flag comes from `radixserve.settings.ServerSettings` (see `--help`); the SGLang spellings
are canonical and the seed article's spellings (`--chunk-prefill-size`, `--radix-cache-policy`,
`--mem-fraction`) are aliases. With `--dp-size N` it starts N workers behind a router whose policy
is `--router-policy` (default cache_aware). With `--nnodes N --node-rank K --dist-init-addr
HOST:PORT` one tensor-parallel engine spans N machines: node 0 serves HTTP, node K > 0 runs only
its ranks (radixserve.engine.tp_node).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from radixserve.process.spawn import SETTINGS_FD_FLAG, read_settings_fd
from radixserve.settings import ServerSettings, add_settings_arguments, settings_from_args

DEFAULT_ROUTER_POLICY = "cache_aware"


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    from radixserve.router.policies import POLICIES

    parser = argparse.ArgumentParser(
        prog=prog, description="radixserve: an OpenAI-compatible LLM server over a radix-tree KV cache.",
    )
    add_settings_arguments(parser)
    for action in parser._actions:
        if action.dest == "dp_size":
            action.help = ("Data-parallel engine workers (one per GPU when there are enough), behind a built-in "
                           "router on --host/--port whose policy is --router-policy (default: 1, no router).")
    parser.add_argument("--router-policy", default=None, choices=POLICIES,
                        help=f"Routing policy of the --dp-size router (default: {DEFAULT_ROUTER_POLICY}); "
                             "see python -m radixserve.launch_router --help.")
    # How the --dp-size launcher hands a worker its settings, keys included, off the command line
    # (radixserve.process.spawn): every other flag is then ignored.
    parser.add_argument(SETTINGS_FD_FLAG, dest="settings_from_fd", type=read_settings_fd, default=None,
                        help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Optional[list[str]] = None,
               prog: Optional[str] = None) -> tuple[ServerSettings, str]:
    """The server settings and the --dp-size router's policy."""
    from radixserve.http_common.api_keys import load_admin_key, load_key_ring

    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        if args.settings_from_fd is not None:
            settings = ServerSettings(**args.settings_from_fd)
        else:
            settings = settings_from_args(args)
        # A bad key file: one line, now.
        load_key_ring(settings.api_key, settings.api_key_file, warn=False)
        load_admin_key(settings.admin_api_key, settings.admin_api_key_file)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
    if args.router_policy is not None and settings.dp_size < 2:
        parser.error("--router-policy chooses the policy of the --dp-size router: it needs --dp-size 2 or more")
    return settings, args.router_policy or DEFAULT_ROUTER_POLICY


def parse_settings(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> ServerSettings:
    return parse_args(argv, prog)[0]


def main(argv: Optional[list[str]] = None) -> int:
    settings, router_policy = parse_args(
        argv, prog="radixserve serve" if argv is not None else "python -m radixserve.launch_server")
    from radixserve.process.logging_setup import setup_logging
    from radixserve.server.startup import StartupError, check_before_loading, silence_tokenizer_length_warning

    setup_logging(settings.log_level, settings.log_file)
    if settings.node_rank > 0:
        return run_other_node(settings)
    try:  # before the engine starts or anything loads: a wrong path or a busy port fails at once
        check_before_loading(settings)
    except StartupError as e:
        logging.getLogger("radixserve").error("server failed: %s", e)
        return 1
    silence_tokenizer_length_warning()
    if settings.dp_size > 1:  # N workers behind a router with router_policy, on settings.host:port
        from radixserve.launch_router import run_data_parallel

        return run_data_parallel(settings, policy=router_policy)
    from radixserve.server.api_server import run_server

    try:
        code = run_server(settings)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # startup failures: say why in one line, no traceback
        logging.getLogger("radixserve").error("server failed: %s", e)
        return 1
    exit_without_waiting_for_threads(code)
    return code


def run_other_node(settings: ServerSettings) -> int:
    """Node K > 0 of a multi-node engine: this node's ranks only, no HTTP server."""
    import dataclasses

    from radixserve.default_model import ensure_model_path
    from radixserve.engine.tp_node import run_node
    from radixserve.server.startup import (StartupError, check_context_length, check_hicache_memory,
                                           check_model_path, check_quantization)

    log = logging.getLogger("radixserve")
    try:
        for check in (check_model_path, check_quantization, check_context_length, check_hicache_memory):
            check(settings)
        return run_node(dataclasses.replace(settings, model_path=ensure_model_path(settings.model_path)))
    except (StartupError, ValueError) as e:
        log.error("node %d failed: %s", settings.node_rank, e)
        return 1


def exit_without_waiting_for_threads(code: int) -> None:
    """End the process now if worker threads are still busy (a grammar check compiling a large
    schema, a long tokenization for a request the shutdown cut): the interpreter would join them
    at exit, which took 10.6 s after SIGTERM once and printed a traceback. Everything that needs
    closing is closed by now; the log is flushed first."""
    import os
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
