"""The API-server process: bind ZMQ, report the endpoints, wait for every engine,
then listen on its own SO_REUSEPORT socket and serve HTTP with uvicorn."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
from multiprocessing.connection import Connection

import uvicorn

from frontend.admission import Admission
from frontend.app import build_app
from frontend.config import APIServerConfig
from frontend.engine_client import ClientConfig, EngineClient
from frontend.metrics import Metrics
from frontend.renderer import Renderer
from frontend.serving import ServingContext
from frontend.stats_logger import log_stats_forever
from protocol.lifecycle import die_with_parent
from protocol.logs import setup_logging
from protocol.sockets import is_ipv6

log = logging.getLogger("zserve.api")


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


class APIServer:
    def __init__(self, cfg: APIServerConfig, pipe: Connection | None) -> None:
        self.cfg = cfg
        self.pipe = pipe
        fc = cfg.frontend
        self.client = EngineClient(
            ClientConfig(
                client_index=cfg.client_index,
                num_engines=fc.num_engines,
                input_address=cfg.input_address,
                output_address=cfg.output_address,
                curve=fc.curve,
            )
        )
        self.report(("addresses", self.client.input_address, self.client.output_address))
        self.renderer = Renderer(fc.tokenizer_dir, fc.model_dir, fc.chat_template)
        self.admission = Admission(
            cfg.admission_path,
            cfg.client_index,
            fc.api_server_count,
            fc.max_num_queued_reqs,
            fc.max_num_queued_tokens,
        )
        self.ctx = ServingContext(fc, self.client, self.renderer, self.admission)
        self.server: uvicorn.Server | None = None
        self.tasks: list[asyncio.Task] = []

    def report(self, message: tuple) -> None:
        if self.pipe is not None:
            self.pipe.send(message)

    async def serve(self) -> None:
        fc = self.cfg.frontend
        await self.client.wait_for_engines(fc.engine_ready_timeout_s)
        self.ctx.metrics = Metrics(
            fc.metrics_prefix, self.ctx.model_name, self.client, self.client.max_model_len
        )
        app = build_app(self.ctx)
        if not fc.disable_log_stats and self.cfg.client_index == 0:
            self.tasks.append(asyncio.create_task(log_stats_forever(self.client)))
        config = uvicorn.Config(
            app,
            loop="none",
            http="httptools",
            lifespan="off",
            log_level=fc.uvicorn_log_level,
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=max(fc.shutdown_timeout, 1.0),
            root_path=fc.root_path,
            ssl_keyfile=fc.ssl_keyfile,
            ssl_certfile=fc.ssl_certfile,
        )
        self.server = uvicorn.Server(config)
        # Our own signal handling (below) replaces uvicorn's.
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        sock = listen_socket(fc.host, fc.port)
        gc.collect()
        gc.freeze()  # start-up objects never need scanning again
        self.report(("serving", os.getpid()))
        log.info("API server %d serving on port %d", self.cfg.client_index, fc.port)
        try:
            await self.server.serve(sockets=[sock])
        finally:
            sock.close()
            self.client.close()

    def shutdown(self) -> None:
        self.ctx.draining = True
        if self.server is not None:
            self.server.should_exit = True


def run_api_server(cfg: APIServerConfig, pipe: Connection | None = None) -> None:
    """Process entry point of one API server."""
    setup_logging(f"api{cfg.client_index}", cfg.frontend.log_level)
    die_with_parent(cfg.parent_pid)
    import uvloop

    uvloop.install()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    server = APIServer(cfg, pipe)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.shutdown)
    try:
        loop.run_until_complete(server.serve())
    except TimeoutError as e:
        log.error("%s", e)
        raise SystemExit(3) from None
    finally:
        loop.close()
