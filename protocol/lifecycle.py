"""Process life-cycle rules every zserve child follows."""

from __future__ import annotations

import os
import signal


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies, even by SIGKILL,
    so no child outlives its supervisor."""
    if parent_pid is None:
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def name_process(name: str) -> None:
    """Show `name` (e.g. "zserve-engine0") in ps/top instead of "python3"."""
    try:
        import ctypes

        PR_SET_NAME = 15
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def pin_to_cpus(cpus: list[int] | None) -> None:
    """Keep this process (and the threads it starts later) on these CPUs."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim), e.g. after a
    large request: without it a process keeps the peak of its heap for good. Returns
    False where the C library has no malloc_trim."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
