"""One log format for every zserve process: each line names the process role and index."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(role: str, level: str = "INFO") -> None:
    """Configure the root logger of this process, e.g. role "api1" or "engine0"."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s [{role} pid={os.getpid()}] %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
