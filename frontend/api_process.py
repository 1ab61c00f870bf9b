"""An API-server process, whatever door it serves (HTTP in server.py, gRPC in
grpc_server.py): bind ZMQ, report the endpoints, wait for every engine, open the door
on this process's own SO_REUSEPORT listener, and drain on SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from multiprocessing.connection import Connection

from frontend.admission import Admission
from frontend.config import APIServerConfig
from frontend.control import ControlMessage, EndpointsBound, EngineDead, Serving
from frontend.engine_client import EngineClient
from frontend.engine_state import ClientConfig
from frontend.errors import APIError
from frontend.memory import release_free_memory
from frontend.metrics import Metrics
from frontend.renderer import Renderer
from frontend.serving import ServingContext
from frontend.stats_logger import log_stats_forever
from frontend.tokenizer_pool import TokenizerPool
from frontend.tracing import RequestTracer

log = logging.getLogger("zserve.api")


class APIProcess:
    """The engine client, admission, renderer, tokenizer pool and serving context of
    one API server, and its life; a subclass opens, serves and closes its door."""

    door = "?"  # what the log lines call this process's protocol

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
        self.renderer = Renderer(fc.tokenizer_dir, fc.chat_template)
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
        self.tasks: list[asyncio.Task] = []
        self.draining: asyncio.Task | None = None
        self.main: asyncio.Task | None = None  # serve(), set by run_api_process
        self.door_open = False

    # --- the door: what a subclass provides ---------------------------------------------

    async def open_door(self) -> None:
        """Listen on this process's own socket of the shared port; return once bound."""
        raise NotImplementedError

    async def serve_door(self) -> None:
        """Serve until stop_door() has been called and the door is closed."""
        raise NotImplementedError

    def stop_door(self) -> None:
        """Stop serving (after the drain): serve_door() returns soon after."""
        raise NotImplementedError

    # --- the supervisor's pipe ----------------------------------------------------------

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
        self.report(EngineDead(engine.rank, engine.dead_reason, incarnation, engine.dead_stuck))

    def on_control_message(self) -> None:
        """Messages from the supervisor on our pipe."""
        try:
            message = self.pipe.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.pipe.fileno())
            return
        if isinstance(message, EngineDead) and 0 <= message.rank < len(self.client.engines):
            self.client.engine_died(message.rank, message.reason, message.incarnation)

    # --- the whole life -------------------------------------------------------------------

    async def serve(self) -> None:
        fc = self.cfg.frontend
        await self.client.wait_for_engines(fc.engine_ready_timeout_s)
        self.ctx.metrics = Metrics(
            fc.metrics_prefix, self.ctx.model_name, self.client, self.client.max_model_len
        )
        self.client.on_loop_lag = self.ctx.metrics.loop_lag.set
        if fc.otlp_traces_endpoint:
            self.ctx.tracer = RequestTracer(
                fc.otlp_traces_endpoint, self.ctx.model_name, self.cfg.client_index
            )
        if not fc.disable_log_stats and self.cfg.client_index == 0:
            self.tasks.append(asyncio.create_task(log_stats_forever(self.client)))
        self.tasks.append(asyncio.create_task(release_memory_forever(self.ctx)))
        if self.pipe is not None:
            asyncio.get_running_loop().add_reader(self.pipe.fileno(), self.on_control_message)
        if self.cfg.restarts:
            self.ctx.metrics.api_server_restarts.inc()
        try:
            await self.open_door()
            self.door_open = True
            gc.collect()
            gc.freeze()  # start-up objects never need scanning again
            self.report(Serving(os.getpid()))
            place = f"unix socket {fc.uds}" if fc.uds else f"port {fc.port}"
            log.info("API server %d serving %s on %s", self.cfg.client_index, self.door, place)
            await self.serve_door()
        finally:
            for task in self.tasks:
                task.cancel()
            if self.tokenizers is not None:
                self.tokenizers.close()
            if self.ctx.tracer is not None:
                self.ctx.tracer.close()
            self.client.close()

    def shutdown(self) -> None:
        """SIGTERM or SIGINT. Before the door is open nothing is in flight: stop starting
        (waiting for engines can take as long as a model's load) instead of waiting."""
        if not self.door_open and self.main is not None:
            self.main.cancel()
        elif self.draining is None:
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
        self.stop_door()


async def release_memory_forever(ctx: ServingContext, interval_s: float = 2.0) -> None:
    """After a large request (a big body, a wide fan-out) the C heap keeps its peak;
    give the free pages back once such a request is over."""
    while True:
        await asyncio.sleep(interval_s)
        if ctx.large_request_seen and not ctx.active:
            ctx.large_request_seen = False
            release_free_memory()


def run_api_process(cfg: APIServerConfig, pipe: Connection | None, door: type[APIProcess]) -> None:
    """Process entry point of one API server serving `door` (launcher/child_main.py has
    set the process up)."""
    import uvloop

    uvloop.install()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    server = door(cfg, pipe)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.shutdown)
    server.main = loop.create_task(server.serve())
    try:
        loop.run_until_complete(server.main)
    except asyncio.CancelledError:
        log.info("API server %d: stopped before it served", cfg.client_index)
    except TimeoutError as e:
        log.error("%s", e)
        raise SystemExit(3) from None
    finally:
        loop.close()
