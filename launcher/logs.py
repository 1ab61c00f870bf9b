"""One log format for every zserve process: each line names the process role and index."""

from __future__ import annotations

import logging
import os
import sys

# Control characters (and Unicode's line breaks) in a message are written escaped, so
# text a client chose (an id, a name) can never start a forged log line.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, 0x85)}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
_ESCAPES.update({0x2028: "\\u2028", 0x2029: "\\u2029"})


class _OneLineFormatter(logging.Formatter):
    """Escapes the message; a traceback still follows on its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_ESCAPES)
        return super().formatMessage(record)


def setup_logging(role: str, level: str = "INFO") -> None:
    """Configure the root logger of this process, e.g. role "api1" or "engine0"."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _OneLineFormatter(
            f"%(asctime)s %(levelname)s [{role} pid={os.getpid()}] %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
