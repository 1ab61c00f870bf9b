"""Entry points of the spawned children: set the process up, then run its role.

A spawned child imports this module, the launcher modules it names and, lazily, its
role's package: an API server never loads engine_core (nor torch), an engine never
loads the frontend. The configs arrive pickled, so their classes are imported only
by the child that unpickles them."""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from launcher.process_setup import set_up_child

if TYPE_CHECKING:
    from engine_core.config import EngineProcConfig
    from frontend.config import APIServerConfig


def api_server_main(cfg: APIServerConfig, pipe: Connection) -> None:
    """One API server: HTTP, or gRPC with --grpc (the one place that chooses)."""
    set_up_child(f"api{cfg.client_index}", cfg.frontend.log_level, cfg.parent_pid, cfg.cpus)
    if cfg.frontend.grpc:
        from frontend.grpc_server import run_grpc_server

        run_grpc_server(cfg, pipe)
    else:
        from frontend.server import run_api_server

        run_api_server(cfg, pipe)


def engine_main(cfg: EngineProcConfig) -> None:
    # CPUs are pinned before engine_core's import starts torch's threads.
    set_up_child(f"engine{cfg.rank}", cfg.log_level, cfg.parent_pid, cfg.cpus)
    from engine_core.omp_env import set_up_engine_threads  # torch-free; API servers skip it

    set_up_engine_threads()
    from engine_core.process import run_engine_core

    sys.exit(run_engine_core(cfg))
