"""What every process zserve starts does first, whoever starts it (the launcher its
API servers and engines, an API server its tokenizer workers, an engine its grammar
compilers): end with its parent, even when the parent is killed, carry a name in ps,
and hear its stop signals safely. Here, in the one package every other may import."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable, Iterable

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


def on_signals_in_a_thread(signums: Iterable[int], act: Callable[[int], None]) -> None:
    """Call `act(signum)` for each of `signums` received, on a thread of its own rather
    than in the main thread's handler. A handler runs between any two bytecodes of the
    main thread, even inside itself when signals come in a burst (the kernel sends two
    at a parent's death), so one that takes a lock can wait forever on a lock that the
    code it cut into holds: threading.Event.set() does. The handler left in the main
    thread does nothing; the signal reaches the thread through the wakeup fd. Call it
    from the main thread; nothing else in the process may set the wakeup fd."""
    wanted = set(signums)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in wanted:
        signal.signal(signum, _ignore)

    def watch() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum in wanted:
                    act(signum)

    threading.Thread(target=watch, name="signals", daemon=True).start()


def _ignore(signum, frame) -> None:
    pass
