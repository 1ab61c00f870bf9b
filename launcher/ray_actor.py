"""The Ray actor that holds one engine core (--data-parallel-backend ray).

It runs the engine process code itself, EngineCoreProc with the EngineProcConfig the
supervisor built, as `run_engine_core` does in a spawned process: the same handshake
(HELLO → PLAN → READY over CURVE-secured TCP), the same sockets to every API server.
Two differences: Ray, not the engine, owns this worker's signals (so `stop()` asks the
engine to end, and the actor runs its methods in threads: `run` busy, `stop` still
answers), and the engine's READY names the Ray node it landed on.

The deployment's CURVE keys arrive inside the config, an argument of `run`: Ray carries
them from the supervisor to this process; nothing is written to disk.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import ray

from engine_core.omp_env import set_up_engine_threads
from launcher.logs import setup_logging
from protocol.process_life import name_process

if TYPE_CHECKING:
    from engine_core.config import EngineProcConfig


@ray.remote(max_concurrency=2)
class EngineActor:
    def __init__(self) -> None:
        self.proc = None

    def run(self, cfg: EngineProcConfig) -> int:
        """The engine's whole life; its exit code (0 after stop(), 1 after a failure)."""
        setup_logging(f"engine{cfg.rank}", cfg.log_level)
        name_process(f"zserve-engine{cfg.rank}")
        set_up_engine_threads()
        from engine_core.process import EngineCoreProc

        node_id = ray.get_runtime_context().get_node_id()
        self.proc = EngineCoreProc(dataclasses.replace(cfg, node_id=node_id))
        return self.proc.run()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop.set()
