"""How every zserve process starts, before its role's code runs: one log format, no
outliving the supervisor, a name in ps, its CPUs, room for sockets. The launcher's
entry points apply these to each child (child_main.py); the supervisor to itself."""

from __future__ import annotations

import faulthandler
import logging
import os
import resource
import signal

from launcher.logs import setup_logging
from protocol.process_life import die_with_parent, name_process

log = logging.getLogger("zserve.supervisor")

# Open files per process: room for thousands of concurrent streams per API server, and
# a ceiling on what a flood of connections can make one process hold.
OPEN_FILES = 65_536

# `kill -USR1 <pid>` of any zserve process: every thread's Python stack on its stderr
# (the server's log). The supervisor sends it to a hung engine before it kills it.
STACKS_SIGNAL = signal.SIGUSR1


def set_up_child(role: str, log_level: str, parent_pid: int | None, cpus: list[int] | None) -> None:
    """A spawned child's first act, e.g. role "api1" or "engine0": its log lines, its
    death with the supervisor, its name `zserve-<role>`, its CPUs (before any library
    starts threads, which inherit them)."""
    setup_logging(role, log_level)
    die_with_parent(parent_pid)
    name_process(f"zserve-{role}")
    pin_to_cpus(cpus)
    dump_stacks_on_signal()


def dump_stacks_on_signal() -> None:
    """Written by faulthandler's C handler: it works while a thread holds the GIL in a
    kernel that never returns, which is when it is needed."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)


def pin_to_cpus(cpus: list[int] | None) -> None:
    """Keep this process (and the threads it starts later) on these CPUs."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def raise_open_files_limit() -> None:
    """Thousands of streams need thousands of sockets: soft limit up to OPEN_FILES (or
    the hard limit, if lower). Children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)
