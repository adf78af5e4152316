"""Start the HTTP server: `python -m radixserve.launch_server --model-path ... --port 8000`.

Every flag comes from `radixserve.settings.ServerSettings` (see `--help`); the SGLang spellings
are canonical and the seed article's spellings (`--chunk-prefill-size`, `--radix-cache-policy`,
`--mem-fraction`) are aliases.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from radixserve.settings import ServerSettings, add_settings_arguments, settings_from_args


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="radixserve: an OpenAI-compatible LLM server over a radix-tree KV cache.",
    )
    add_settings_arguments(parser)
    return parser


def parse_settings(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> ServerSettings:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return settings_from_args(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def main(argv: Optional[list[str]] = None) -> int:
    settings = parse_settings(argv, prog="radixserve serve" if argv is not None else None)
    if settings.dp_size > 1:  # N workers behind the cache-aware router, on settings.host:port
        from radixserve.launch_router import run_data_parallel
        from radixserve.server.logging_setup import setup_logging

        setup_logging(settings.log_level, settings.log_file)
        return run_data_parallel(settings)
    from radixserve.server.api_server import run_server
    from radixserve.server.logging_setup import setup_logging

    setup_logging(settings.log_level, settings.log_file)
    try:
        return run_server(settings)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # startup failures: say why in one line, no traceback
        logging.getLogger("radixserve").error("server failed: %s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
