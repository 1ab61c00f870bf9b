"""Entry points of the spawned children. Spawned processes import only this module
and what their target needs: an API server never imports engine_core (or torch)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from engine_core.process_config import EngineProcConfig

if TYPE_CHECKING:
    from frontend.config import APIServerConfig

__all__ = ["EngineProcConfig", "api_server_main", "engine_main"]


def api_server_main(cfg: APIServerConfig, pipe) -> None:
    """One API server: HTTP, or gRPC with --grpc (the one place that chooses)."""
    if cfg.frontend.grpc:
        from frontend.grpc_server import run_grpc_server

        run_grpc_server(cfg, pipe)
    else:
        from frontend.server import run_api_server

        run_api_server(cfg, pipe)


def engine_main(cfg: EngineProcConfig) -> None:
    from engine_core.process import run_engine_core

    sys.exit(run_engine_core(cfg))
