"""The API server's C heap: handing a large request's peak back to the OS."""

from __future__ import annotations

import ctypes


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim), e.g. after a
    large request: without it a process keeps the peak of its heap for good. Returns
    False where the C library has no malloc_trim."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
