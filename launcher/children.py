"""The supervisor's children: spawning one, hearing from it, telling how it ended,
stopping them all."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, TypeVar

from frontend.control import ControlMessage
from launcher import child_main

if TYPE_CHECKING:
    from engine_core.config import EngineProcConfig
    from frontend.config import APIServerConfig

log = logging.getLogger("zserve.supervisor")

# Children start fresh interpreters: nothing of the supervisor's state (ZMQ contexts,
# threads, the held port) leaks into them.
_SPAWN = mp.get_context("spawn")

M = TypeVar("M", bound=ControlMessage)


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    """One spawned process, as the supervisor tracks it."""

    name: str  # for log lines, e.g. "API server 1" or "engine 0"
    process: BaseProcess
    pipe: Connection | None = None  # API servers: the control pipe (frontend/control.py)
    config: APIServerConfig | None = None  # API servers: what a restart hands it again
    rank: int = -1  # engines: its data-parallel rank


def spawn_api_server(cfg: APIServerConfig) -> Child:
    parent_end, child_end = _SPAWN.Pipe()
    process = _SPAWN.Process(
        target=child_main.api_server_main, args=(cfg, child_end), name=f"api{cfg.client_index}"
    )
    process.start()
    child_end.close()
    return Child(f"API server {cfg.client_index}", process, parent_end, config=cfg)


def spawn_engine(cfg: EngineProcConfig) -> Child:
    process = _SPAWN.Process(target=child_main.engine_main, args=(cfg,), name=f"engine{cfg.rank}")
    process.start()
    return Child(f"engine {cfg.rank}", process, rank=cfg.rank)


def receive(child: Child, kind: type[M], timeout_s: float, check: Callable[[], None]) -> M:
    """The next message of `kind` from an API server; `check` raises if a child died
    meanwhile (a death also closes the pipe, which is not an answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        if child.pipe.poll(0.2):
            try:
                message = child.pipe.recv()
            except EOFError:
                continue  # the death is reported by check()
            if isinstance(message, kind):
                return message
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} did not report {kind.__name__} in {timeout_s:.0f} s")


def check_alive(children: list[Child], starting: bool) -> None:
    for child in children:
        code = child.process.exitcode
        if code is not None:
            when = "during start-up" if starting else "unexpectedly"
            raise StartupError(
                f"{child.name} (pid {child.process.pid}) exited {when} with code "
                f"{describe(code)}; see its log lines above"
            )


def describe(code: int | None) -> str:
    """An exit code, with the signal's name when a signal ended the process."""
    if code is not None and code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def stop_all(processes: list[BaseProcess], grace_s: float) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL: nothing outlives the supervisor."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            if grace_s > 0:  # none: the kill is the plan, not news
                log.warning("%s did not stop in %.0f s; killing it", p.name, grace_s)
            p.kill()
            p.join(5)
