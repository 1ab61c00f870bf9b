"""The HTTP API-server process: Starlette on uvicorn, on its own SO_REUSEPORT listener,
or with --uds on the supervisor's Unix socket (the process around it, shared with the
gRPC door, is api_process.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from multiprocessing.connection import Connection

import uvicorn

from frontend.accept_gate import AcceptGate, connection_cap
from frontend.api_process import APIProcess, run_api_process
from frontend.app import build_app
from frontend.config import APIServerConfig
from frontend.http_limits import guarded_protocol
from frontend.tls_refresh import TLSRefresher
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
        self.gate: AcceptGate | None = None

    async def open_door(self) -> None:
        fc = self.cfg.frontend
        self.gate = AcceptGate(connection_cap())
        config = uvicorn.Config(
            build_app(self.ctx),
            loop="none",
            http=guarded_protocol(fc.limits, self.gate),
            lifespan="off",
            log_config=None,  # uvicorn's lines, access lines included, in zserve's format
            log_level=fc.uvicorn_log_level,
            access_log=fc.access_log,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=max(fc.shutdown_timeout, 1.0),
            ssl_keyfile=fc.ssl_keyfile,
            ssl_certfile=fc.ssl_certfile,
            ssl_ca_certs=fc.ssl_ca_certs,
            ssl_cert_reqs=fc.ssl_cert_reqs,
            **({"ssl_ciphers": fc.ssl_ciphers} if fc.ssl_ciphers else {}),
        )
        config.load()  # the SSL context now, for the refresher to reload into
        if fc.access_log and fc.access_log_skip:
            logging.getLogger("uvicorn.access").addFilter(SkipPaths(fc.access_log_skip))
        if fc.ssl_refresh and config.ssl is not None:
            refresher = TLSRefresher(config.ssl, fc.ssl_certfile, fc.ssl_keyfile, fc.ssl_ca_certs)
            self.tasks.append(asyncio.create_task(refresher.run()))
        self.server = _Server(config)
        self.sock = self.cfg.listener or listen_socket(fc.host, fc.port)

    async def serve_door(self) -> None:
        try:
            await self.server.serve(sockets=self.gate.serving(self.server, self.sock))
        finally:
            self.sock.close()

    def stop_door(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class SkipPaths(logging.Filter):
    """--disable-access-log-for-endpoints: no access line for these paths (exact, without
    the query). uvicorn's access record carries the path as its third argument."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM means drain (APIProcess.drain)."""

    def capture_signals(self):
        return contextlib.nullcontext()


def run_api_server(cfg: APIServerConfig, pipe: Connection | None = None) -> None:
    """Process entry point of one HTTP API server."""
    run_api_process(cfg, pipe, APIServer)
