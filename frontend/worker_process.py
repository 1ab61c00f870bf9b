"""What a worker process of the API server (a tokenizer worker) does first: end with
the API server, even when that one is killed, and carry a name in ps.

The launcher applies the same rules to the processes it starts (launcher/
process_setup.py); the frontend may not import the launcher, hence this twin."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM from the kernel when the parent dies, so no worker is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def name_process(name: str) -> None:
    """Show `name` (at most 15 bytes) in ps/top instead of "python3"."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
