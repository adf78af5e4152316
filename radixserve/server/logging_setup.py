"""Log format shared by the API and engine processes.

The message is always the last thing on a line, so a batch line's last field is its
`prefix_hit_rate` and `awk '{print $NF}'` prints it. Both processes append to the same
`--log-file`; lines are written whole in append mode, so they do not interleave mid-line.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

LOG_FORMAT = "[%(asctime)s.%(msecs)03d %(process)d %(levelname)s] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def setup_logging(level: str = "info", log_file: Optional[str] = None) -> None:
    """Route the `radixserve` logger to stderr and, when given, to `log_file`."""
    logger = logging.getLogger("radixserve")
    logger.setLevel(level.upper())
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(LOG_FORMAT, DATE_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, mode="a", encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
