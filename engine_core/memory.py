"""The engine process's C heap: what it hands back to the OS, and when."""

from __future__ import annotations

import ctypes


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim): the busy loop
    calls it once idle, so a burst's peak does not stay with the process for good.
    Returns False where the C library has no malloc_trim."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
