"""The `radixserve` console script: `radixserve serve|bench|experiment|route [flags]`.

Each command is a module with `main(argv) -> int | None`, imported only when it runs, so the
server's dependencies are not loaded to run the benchmark client and the other way round.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

COMMANDS = {
    "serve": ("radixserve.launch_server", "start the HTTP server (same flags as python -m radixserve.launch_server)"),
    "bench": ("radixserve.bench_serving", "benchmark a running server (python -m radixserve.bench_serving)"),
    "experiment": ("radixserve.experiment", "run a scripted experiment"),
    "route": ("radixserve.launch_router", "start the cache-aware router in front of several workers"),
}


def usage() -> str:
    lines = ["usage: radixserve <command> [flags]", "", "commands:"]
    lines += [f"  {name:<11} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "`radixserve <command> --help` lists a command's flags."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"radixserve: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"radixserve {command}: {module_name} is not available in this installation", file=sys.stderr)
            return 2
        raise
    code = module.main(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
