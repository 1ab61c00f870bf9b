"""The engines one supervisor starts and watches, whatever runs them: local processes
(this module) or Ray actors (ray_engines.py). The supervisor, the monitor and the
restarts see only this interface."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from launcher.children import Child, check_alive, describe, spawn_engine, stop_all
from launcher.process_setup import STACKS_SIGNAL

if TYPE_CHECKING:
    from engine_core.config import EngineProcConfig

log = logging.getLogger("zserve.supervisor")

# How long a hung engine gets to write its stacks (faulthandler, in C) before SIGKILL.
STACKS_WAIT_S = 0.5


@dataclass(frozen=True)
class EngineExit:
    """Engine `rank`, started as `incarnation`, is gone, for `reason`."""

    rank: int
    incarnation: int
    reason: str
    stuck: bool = False  # hung or silent: its process may still run (EngineDead.stuck)


class EngineSet(Protocol):
    def start(self, cfg: EngineProcConfig) -> None:
        """Start engine cfg.rank (again, after its exit and stop)."""

    def waitables(self) -> list[object]:
        """What multiprocessing.connection.wait() can wait on for an exit."""

    def exits(self, ready: object) -> list[EngineExit]:
        """The exits behind a ready waitable (empty if none after all); each engine's
        exit is reported once."""

    def check_alive(self) -> None:
        """During start-up: raise StartupError if an engine has exited."""

    def stop(self, rank: int, dump_stacks: bool = False) -> None:
        """Stop engine `rank` now (it hangs, or died), before it is started again or the
        server fails; `dump_stacks`: it hangs, so first have it write where."""

    def stop_all(self, grace_s: float) -> None:
        """Stop every engine: a signal to end, then force after grace_s."""


class LocalEngines:
    """Engine processes spawned on this node (launcher/children.py)."""

    def __init__(self) -> None:
        self.children: dict[int, Child] = {}  # rank → its current process
        self.incarnations: dict[int, int] = {}

    def start(self, cfg: EngineProcConfig) -> None:
        self.children[cfg.rank] = spawn_engine(cfg)
        self.incarnations[cfg.rank] = cfg.incarnation

    def waitables(self) -> list[object]:
        return [c.process.sentinel for c in self.children.values()]

    def exits(self, ready: object) -> list[EngineExit]:
        for rank, child in list(self.children.items()):
            if child.process.sentinel == ready:
                child.process.join(1)  # reap it, so its exit code is known
                del self.children[rank]
                reason = (
                    f"{child.name} (pid {child.process.pid}) died with exit code "
                    f"{describe(child.process.exitcode)}"
                )
                return [EngineExit(rank, self.incarnations[rank], reason)]
        return []

    def check_alive(self) -> None:
        check_alive(list(self.children.values()), starting=True)

    def stop(self, rank: int, dump_stacks: bool = False) -> None:
        child = self.children.pop(rank, None)
        if child is None:
            return
        if dump_stacks and child.process.is_alive():
            log.error(
                "%s (pid %d) hangs: its threads' stacks follow, then it is killed",
                child.name,
                child.process.pid,
            )
            try:
                os.kill(child.process.pid, STACKS_SIGNAL)
            except ProcessLookupError:
                pass
            child.process.join(STACKS_WAIT_S)  # it goes on (or stays stopped); the dump is out
        stop_all([child.process], grace_s=0.0)

    def stop_all(self, grace_s: float) -> None:
        stop_all([c.process for c in self.children.values()], grace_s=grace_s)
