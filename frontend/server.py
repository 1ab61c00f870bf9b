"""The HTTP API-server process: Starlette on uvicorn, on its own SO_REUSEPORT listener
(the process around it, shared with the gRPC door, is api_process.py)."""

from __future__ import annotations

import contextlib
import socket
from multiprocessing.connection import Connection

import uvicorn

from frontend.api_process import APIProcess, run_api_process
from frontend.app import build_app
from frontend.config import APIServerConfig
from frontend.http_limits import guarded_protocol
from protocol.sockets import is_ipv6


def listen_socket(host: str | None, port: int, backlog: int = 4096) -> socket.socket:
    """This process's own listener on the shared port: the kernel spreads new
    connections evenly over every SO_REUSEPORT listener of the group."""
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


class APIServer(APIProcess):
    """OpenAI's HTTP API (app.py) served by uvicorn."""

    door = "HTTP"

    def __init__(self, cfg: APIServerConfig, pipe: Connection | None) -> None:
        super().__init__(cfg, pipe)
        self.server: uvicorn.Server | None = None
        self.sock: socket.socket | None = None

    async def open_door(self) -> None:
        fc = self.cfg.frontend
        config = uvicorn.Config(
            build_app(self.ctx),
            loop="none",
            http=guarded_protocol(fc.limits),
            lifespan="off",
            log_level=fc.uvicorn_log_level,
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=max(fc.shutdown_timeout, 1.0),
            ssl_keyfile=fc.ssl_keyfile,
            ssl_certfile=fc.ssl_certfile,
        )
        self.server = _Server(config)
        self.sock = listen_socket(fc.host, fc.port)

    async def serve_door(self) -> None:
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            self.sock.close()

    def stop_door(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM means drain (APIProcess.drain)."""

    def capture_signals(self):
        return contextlib.nullcontext()


def run_api_server(cfg: APIServerConfig, pipe: Connection | None = None) -> None:
    """Process entry point of one HTTP API server."""
    run_api_process(cfg, pipe, APIServer)
