"""The API-server process: bind ZMQ, report the endpoints, wait for every engine,
then listen on its own SO_REUSEPORT socket and serve HTTP with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
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
from frontend.control import ControlMessage, EndpointsBound, EngineDead, Serving
from frontend.engine_client import ClientConfig, EngineClient
from frontend.errors import APIError
from frontend.http_limits import guarded_protocol
from frontend.memory import release_free_memory
from frontend.metrics import Metrics
from frontend.renderer import Renderer
from frontend.serving import ServingContext
from frontend.stats_logger import log_stats_forever
from frontend.tokenizer_pool import TokenizerPool
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
                heartbeat_timeout_s=fc.engine_heartbeat_timeout_s,
            )
        )
        self.client.on_engine_dead = self.on_engine_dead
        self.report(EndpointsBound(self.client.input_address, self.client.output_address))
        self.renderer = Renderer(fc.tokenizer_dir, fc.model_dir, fc.chat_template)
        self.admission = Admission(
            cfg.admission_path,
            cfg.client_index,
            fc.api_server_count,
            fc.max_num_queued_reqs,
            fc.max_num_queued_tokens,
        )
        self.tokenizers = (
            TokenizerPool(
                self.renderer.serialized(), fc.tokenizer_pool_size, timeout_s=fc.tokenize_timeout_s
            )
            if fc.tokenizer_pool_size > 0
            else None
        )
        self.ctx = ServingContext(
            fc, self.client, self.renderer, self.admission, tokenizers=self.tokenizers
        )
        self.server: uvicorn.Server | None = None
        self.tasks: list[asyncio.Task] = []
        self.draining: asyncio.Task | None = None

    def report(self, message: ControlMessage) -> None:
        if self.pipe is not None:
            try:
                self.pipe.send(message)
            except (BrokenPipeError, OSError):
                pass  # the supervisor is gone; PR_SET_PDEATHSIG ends us shortly

    def on_engine_dead(self, engine) -> None:
        """Tell the supervisor, which stops the server so an orchestrator restarts it
        (or, with --engine-restart-policy on-failure, starts that engine again)."""
        incarnation = engine.ready.incarnation if engine.ready else -1
        self.report(EngineDead(engine.rank, engine.dead_reason, incarnation))

    def on_control_message(self) -> None:
        """Messages from the supervisor on our pipe."""
        try:
            message = self.pipe.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.pipe.fileno())
            return
        if isinstance(message, EngineDead) and 0 <= message.rank < len(self.client.engines):
            self.client.engine_died(message.rank, message.reason, message.incarnation)

    async def serve(self) -> None:
        fc = self.cfg.frontend
        await self.client.wait_for_engines(fc.engine_ready_timeout_s)
        self.ctx.metrics = Metrics(
            fc.metrics_prefix, self.ctx.model_name, self.client, self.client.max_model_len
        )
        self.client.on_loop_lag = self.ctx.metrics.loop_lag.set
        app = build_app(self.ctx)
        if not fc.disable_log_stats and self.cfg.client_index == 0:
            self.tasks.append(asyncio.create_task(log_stats_forever(self.client)))
        self.tasks.append(asyncio.create_task(release_memory_forever(self.ctx)))
        config = uvicorn.Config(
            app,
            loop="none",
            http=guarded_protocol(fc.limits),
            lifespan="off",
            log_level=fc.uvicorn_log_level,
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=max(fc.shutdown_timeout, 1.0),
            root_path=fc.root_path,
            ssl_keyfile=fc.ssl_keyfile,
            ssl_certfile=fc.ssl_certfile,
        )
        self.server = _Server(config)
        if self.pipe is not None:
            asyncio.get_running_loop().add_reader(self.pipe.fileno(), self.on_control_message)
        if self.cfg.restarts:
            self.ctx.metrics.api_server_restarts.inc()
        sock = listen_socket(fc.host, fc.port)
        gc.collect()
        gc.freeze()  # start-up objects never need scanning again
        self.report(Serving(os.getpid()))
        log.info("API server %d serving on port %d", self.cfg.client_index, fc.port)
        try:
            await self.server.serve(sockets=[sock])
        finally:
            sock.close()
            for task in self.tasks:
                task.cancel()
            if self.tokenizers is not None:
                self.tokenizers.close()
            self.client.close()

    def shutdown(self) -> None:
        if self.draining is None:
            self.draining = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """SIGTERM: readiness and new requests answer 503 at once; in-flight requests
        get up to --shutdown-timeout seconds, then end with an error event."""
        ctx, timeout = self.ctx, self.cfg.frontend.shutdown_timeout
        ctx.draining = True
        log.info(
            "draining: %d request(s) in flight, up to %g s (--shutdown-timeout)",
            len(ctx.active),
            timeout,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while ctx.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if ctx.active:
            n = self.client.fail_all(
                APIError(
                    f"the server is shutting down: request aborted after the "
                    f"{timeout:g} s drain (--shutdown-timeout)",
                    503,
                )
            )
            log.info("drain over: aborted %d request(s)", n)
            end = loop.time() + 2.0  # let their error events reach the clients
            while ctx.active and loop.time() < end:
                await asyncio.sleep(0.02)
        if self.server is not None:
            self.server.should_exit = True


async def release_memory_forever(ctx: ServingContext, interval_s: float = 2.0) -> None:
    """After a large request (a big body, a wide fan-out) the C heap keeps its peak;
    give the free pages back once such a request is over."""
    while True:
        await asyncio.sleep(interval_s)
        if ctx.large_request_seen and not ctx.active:
            ctx.large_request_seen = False
            release_free_memory()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM means drain (APIServer.drain)."""

    def capture_signals(self):
        return contextlib.nullcontext()


def run_api_server(cfg: APIServerConfig, pipe: Connection | None = None) -> None:
    """Process entry point of one API server, once the launcher has set the process up
    (launcher/child_main.py)."""
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
