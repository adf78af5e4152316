"""Log format shared by the API process, the engine process and its tensor-parallel ranks.

The message is always the last thing on a line, so a batch line's last field is its
`prefix_hit_rate` and `awk '{print $NF}'` prints it. Every process appends to the same
`--log-file`; lines are written whole in append mode, so they do not interleave mid-line. A
process that is one of several alike (a tensor-parallel rank) names itself in the bracket.

One record is always one line: control characters are escaped (a newline becomes the two
characters `\\n`) whatever their source, a client's request id or prompt, an exception message or
a traceback. Text a client sent can then never start a line of its own that a `grep | awk`
pipeline over the log would read as the server's.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Optional

LOG_FORMAT = "[%(asctime)s.%(msecs)03d %(process)d %(levelname)s{label}] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"

# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators (which some
# tools split lines on).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_control(text: str) -> str:
    """`text` with every control character written as an escape (`\\n`, `\\x1b`, `\\u2028`)."""
    if not _CONTROL.search(text):
        return text

    def one(match: re.Match) -> str:
        ch = match.group()
        if ch in _NAMED:
            return _NAMED[ch]
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"

    return _CONTROL.sub(one, text)


class OneLineFormatter(logging.Formatter):
    """The standard format, with the whole record (message, traceback, stack) on one escaped line."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_control(super().format(record))


def setup_logging(level: str = "info", log_file: Optional[str] = None, label: str = "") -> None:
    """Route the `radixserve` logger to stderr and, when given, to `log_file`; `label` (e.g.
    "tp-rank 1") goes in each line's bracket."""
    logger = logging.getLogger("radixserve")
    logger.setLevel(level.upper())
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = OneLineFormatter(LOG_FORMAT.format(label=f" {label}" if label else ""), DATE_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, mode="a", encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
