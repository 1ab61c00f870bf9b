"""What every process zserve starts does first, whoever starts it (the launcher its
API servers and engines, an API server its tokenizer workers, an engine its grammar
compilers): end with its parent, even when the parent is killed, and carry a name in
ps. Here, in the one package every other may import."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def die_with_parent(parent_pid: int | None) -> None:
    """SIGTERM from the kernel when the parent dies (even by SIGKILL), so no child is
    orphaned. None: nothing to do."""
    if parent_pid is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def name_process(name: str) -> None:
    """Show `name` (at most 15 bytes, e.g. "zserve-engine0") in ps/top instead of
    "python3"."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
