"""The API server's link to every engine core: ROUTER out (zmq.asyncio), PULL in.

The PULL, which carries every output, is read by frontend/output_reader.py. Requests
are registered *before* their ADD is sent, so no output can arrive for an unknown
request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from frontend.engine_state import (
    LONGEST_STEP_TIMEOUTS,
    ClientConfig,
    EngineAsleepError,
    EngineDeadError,
    EngineState,
    RequestStream,
    Wakeup,
)
from frontend.output_reader import OutputReader
from protocol import codec
from protocol.controls import HOLD_ALL
from protocol.keys import start_authenticator
from protocol.messages import (
    EngineCoreRequest,
    EngineReady,
    RequestType,
    SchedulerStats,
    UtilityCall,
    others_requests,
)
from protocol.sockets import (
    bind,
    identity_rank,
    make_socket,
    needs_curve,
    rank_identity,
)

log = logging.getLogger("zserve.client")

# Requests' worth of load an engine counts for a LoRA request when the adapter is not in
# its memory: enough to prefer a warm engine at about the same load, not to pile on it.
LORA_COLD_PENALTY = 2


class EngineClient:
    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.client_index = config.client_index
        self.ctx = zmq.asyncio.Context()
        tcp = needs_curve(config.input_address) or needs_curve(config.output_address)
        # ZAP before bind: our CURVE sockets admit only the deployment's key.
        self.auth = start_authenticator(self.ctx, config.curve) if config.curve and tcp else None
        self.router = make_socket(
            self.ctx,
            zmq.ROUTER,
            curve=config.curve if needs_curve(config.input_address) else None,
            curve_server=True,
        )
        # Sending to an engine we have not heard from raises instead of vanishing.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted engine connects with its rank's identity while the dead one's
        # connection may linger (a node gone without a TCP reset): the newcomer wins.
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # The PULL is a plain socket on the same libzmq context (so the same ZAP
        # handler): a callback on its descriptor reads it (output_reader.py).
        self.pull = make_socket(
            zmq.Context.shadow(self.ctx.underlying),
            zmq.PULL,
            curve=config.curve if needs_curve(config.output_address) else None,
            curve_server=True,
        )
        self.input_address = bind(self.router, config.input_address)
        self.output_address = bind(self.pull, config.output_address)
        self.engines = [
            EngineState(rank, rank_identity(rank)) for rank in range(config.num_engines)
        ]
        self.requests: dict[str, RequestStream] = {}
        self._rotate = itertools.count()
        self._groups = itertools.count(1)
        self._utility_ids = itertools.count(1)
        self.utility_waiters: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self.outputs = OutputReader(self)
        self.on_engine_dead: Callable[[EngineState], None] | None = None
        self.on_loop_lag: Callable[[float], None] | None = None  # this loop's lag, each tick
        self.dead = False

    # --- start-up -----------------------------------------------------------------

    async def wait_for_engines(self, timeout_s: float) -> None:
        """Wait until every engine has announced itself on our ROUTER."""
        deadline = time.monotonic() + timeout_s
        pending = {e.rank for e in self.engines}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.router.poll(int(remaining * 1000)):
                raise TimeoutError(
                    f"engines {sorted(pending)} did not connect to API server "
                    f"{self.client_index} within {timeout_s:.0f} s"
                )
            self._on_router_message(await self.router.recv_multipart(), pending)
        now = time.monotonic()
        for engine in self.engines:
            engine.last_seen = engine.steps_changed_at = now
        self.outputs.start()
        self._tasks.append(asyncio.create_task(self._router_reader(), name="router-reader"))
        self._tasks.append(asyncio.create_task(self._watchdog(), name="engine-watchdog"))

    def _on_router_message(self, frames: list[bytes], pending: set[int] | None = None) -> None:
        """An engine's (re)announcement on our ROUTER."""
        if len(frames) != 2:
            log.warning("dropped a %d-frame message on the request socket", len(frames))
            return
        rank = identity_rank(frames[0])
        try:
            ready = codec.decode_ready(frames[1])
        except codec.DecodeError as e:
            log.warning("dropped an undecodable announcement from %r: %s", frames[0], e)
            return
        if not 0 <= rank < len(self.engines) or ready.rank != rank:
            log.warning("dropped an announcement from unknown engine rank %d", rank)
            return
        engine = self.engines[rank]
        if pending is None and engine.ready is not None:
            if ready.incarnation < engine.ready.incarnation:
                log.warning("dropped a stale announcement of engine %d", rank)
                return
            if ready.incarnation > engine.ready.incarnation:
                self._rejoin(engine, ready)
                return
        engine.ready = ready
        engine.last_seen = time.monotonic()
        if pending is not None:
            pending.discard(rank)

    def _rejoin(self, engine: EngineState, ready: EngineReady) -> None:
        """A restarted engine (a higher incarnation) announced itself: it takes
        traffic again. Requests of its earlier incarnation died with it; if we had not
        noticed that death yet, they fail now."""
        if engine.alive:
            self._fail_streams(engine, EngineDeadError(f"engine {engine.rank} restarted"))
        now = time.monotonic()
        engine.ready = ready
        engine.alive = True
        engine.dead_reason = ""
        engine.dead_stuck = False
        engine.stats = SchedulerStats()
        engine.in_flight = 0
        engine.last_seen = engine.steps_changed_at = now
        self.dead = False
        log.info(
            "engine %d re-joined (incarnation %d, pid %d on %s)",
            engine.rank,
            ready.incarnation,
            ready.pid,
            ready.hostname,
        )

    async def _router_reader(self) -> None:
        while True:
            self._on_router_message(await self.router.recv_multipart())

    @property
    def max_model_len(self) -> int:
        return min(e.ready.max_model_len for e in self.engines if e.ready)

    @property
    def max_request_tokens(self) -> int:
        return min(e.ready.max_request_tokens for e in self.engines if e.ready)

    @property
    def max_beam_width(self) -> int:
        """The widest beam search every engine runs (0: one does not say)."""
        return min(e.ready.max_beam_width for e in self.engines if e.ready)

    @property
    def num_kv_blocks(self) -> int:
        """The smallest engine's usable KV blocks (block 0 is never handed out)."""
        return min(e.ready.num_kv_blocks for e in self.engines if e.ready) - 1

    @property
    def block_size(self) -> int:
        return min(e.ready.block_size for e in self.engines if e.ready)

    @property
    def vocab_size(self) -> int:
        return min(e.ready.vocab_size for e in self.engines if e.ready)

    # --- requests -----------------------------------------------------------------

    def pick_engine(
        self, pinned_rank: int | None = None, prefer_lora: str | None = None
    ) -> EngineState:
        """The engine with the lowest load score; ties rotate.

        Score = this server's own in-flight requests on the engine, counted here and
        so exact at once (a burst that arrives before any stats still spreads
        evenly), plus the other servers' unfinished requests there as the engine last
        reported them (at most ~100 ms old while it works, and its idle state too).
        A request for a LoRA adapter counts LORA_COLD_PENALTY more on an engine that
        does not hold it in memory (it would read the adapter from disk first).
        """
        if pinned_rank is not None:
            engine = self.engines[pinned_rank]
            if not engine.alive:
                raise EngineDeadError(f"engine {pinned_rank} is dead: {engine.dead_reason}")
            if engine.stats.paused:
                raise EngineAsleepError(f"engine {pinned_rank} is asleep")
            return engine
        n = len(self.engines)
        start = next(self._rotate) % n
        best, best_score = None, None
        for i in range(n):
            engine = self.engines[(start + i) % n]
            if not engine.alive or engine.stats.paused:
                continue
            score = self._others_load(engine.stats) + engine.in_flight
            if prefer_lora is not None and prefer_lora not in engine.stats.lora_loaded:
                score += LORA_COLD_PENALTY
            if best_score is None or score < best_score:
                best, best_score = engine, score
        if best is None:
            if any(e.alive for e in self.engines):
                raise EngineAsleepError("every engine is asleep")
            raise EngineDeadError("no engine is alive")
        return best

    def _others_load(self, stats: SchedulerStats) -> int:
        by_client = stats.num_requests_by_client
        if not by_client:  # no per-server split reported: the engine's whole load
            return stats.num_waiting + stats.num_running
        return others_requests(by_client, self.client_index)

    def new_group(self) -> int:
        """A group number for the sequences of one API request (EngineCoreRequest.group)."""
        return next(self._groups)

    def add_request(
        self, request: EngineCoreRequest, engine: EngineState, event: Wakeup | None = None
    ) -> RequestStream:
        if self.dead or not engine.alive:
            raise EngineDeadError(f"engine {engine.rank} is dead: {engine.dead_reason}")
        stream = RequestStream(request.request_id, engine, event, request.num_sequences)
        self.requests[request.request_id] = stream
        engine.in_flight += stream.weight
        request.client_index = self.client_index
        self._send(engine, RequestType.ADD, request)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Forget these requests and tell their engines to free them (idempotent)."""
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            stream = self.requests.pop(rid, None)
            if stream is None:
                continue
            stream.finished = True
            stream.engine.in_flight -= stream.weight
            by_engine.setdefault(stream.engine.rank, []).append(rid)
        for rank, ids in by_engine.items():
            engine = self.engines[rank]
            if engine.alive:
                try:
                    self._send(engine, RequestType.ABORT, ids)
                except EngineDeadError:  # marked dead: nothing of it is left to free
                    pass

    def _send(self, engine: EngineState, kind: RequestType, payload: object) -> None:
        """Raises EngineDeadError where the engine cannot be reached (EHOSTUNREACH: its
        DEALER is gone), having marked it dead. The ROUTER has no high-water mark, so
        its send never waits: the returned future is done, and holds what failed."""
        sent = self.router.send_multipart([engine.identity, *codec.encode_request(kind, payload)])
        error = sent.exception() if sent.done() else None
        if error is not None:
            self.mark_dead(engine, f"cannot reach engine {engine.rank}: {error}")
            raise EngineDeadError(engine.dead_reason) from error

    async def call_utility(self, engine: EngineState, method: str, *args) -> object:
        call_id = next(self._utility_ids)
        future = asyncio.get_running_loop().create_future()
        self.utility_waiters[call_id] = future
        try:
            self._send(
                engine,
                RequestType.UTILITY,
                UtilityCall(call_id, method, [self.client_index, *args]),
            )
            return await future
        finally:
            self.utility_waiters.pop(call_id, None)

    async def _watchdog(self) -> None:
        """An engine is dead when it falls silent (every engine sends a heartbeat each
        second) or hangs: alive, with work, but its step counter stuck.

        Silence is measured in time this loop actually ran: while the loop itself was
        stalled (a long synchronous call), nothing could be read from any engine, so that
        time counts against no engine."""
        timeout = self.config.heartbeat_timeout_s
        interval = min(1.0, timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            lag = max(0.0, now - last - interval)
            last = now
            if self.on_loop_lag is not None:
                self.on_loop_lag(lag)
            for engine in self.engines:
                if not engine.alive:
                    continue
                engine.last_seen += lag
                engine.steps_changed_at += lag
                engine.computing_at += lag
                if now < engine.blocked_until:  # it said it would block this long
                    engine.last_seen = engine.steps_changed_at = now
                    continue
                silent = now - engine.last_seen
                s = engine.stats
                # Asleep, an engine keeps its requests (mode keep) and does not step;
                # paused, it steps only its running requests, or none (mode keep).
                if s.sleep_level or s.generation_hold == HOLD_ALL:
                    busy = False
                elif s.generation_hold:
                    busy = s.num_running
                else:
                    busy = s.num_running or s.num_waiting or engine.in_flight
                if not busy:
                    engine.steps_changed_at = now  # an idle engine is never stuck
                if silent > timeout:
                    self.mark_dead(
                        engine,
                        f"no message for {silent:.1f} s (--engine-heartbeat-timeout {timeout:g})",
                        stuck=True,
                    )
                elif busy and now - engine.steps_changed_at > timeout:
                    self._check_step(engine, now, timeout)

    def _check_step(self, engine: EngineState, now: float, timeout: float) -> None:
        """No step for `timeout` while it has work: hung, unless its CPU time says it
        is in a long step, and that for at most LONGEST_STEP_TIMEOUTS timeouts."""
        stalled = f"hung: no engine step for {now - engine.steps_changed_at:.1f} s"
        flag = f"--engine-heartbeat-timeout {timeout:g}"
        if now - engine.computing_at > timeout:
            self.mark_dead(engine, f"{stalled} while it has work ({flag})", stuck=True)
        elif now - engine.steps_changed_at > LONGEST_STEP_TIMEOUTS * timeout:
            longest = f"a step may take {LONGEST_STEP_TIMEOUTS} x {flag}"
            self.mark_dead(engine, f"{stalled}, computing all along ({longest})", stuck=True)

    def mark_dead(self, engine: EngineState, reason: str, stuck: bool = False) -> None:
        """`stuck`: its process may still run (silent, or not stepping), as opposed
        to gone or unreachable; the supervisor then has it dump its stacks."""
        if not engine.alive:
            return
        engine.alive = False
        engine.dead_reason = reason
        engine.dead_stuck = stuck
        log.error("engine %d is dead: %s", engine.rank, reason)
        self._fail_streams(engine, EngineDeadError(f"engine {engine.rank} died: {reason}"))
        if not any(e.alive for e in self.engines):
            self.dead = True
        if self.on_engine_dead is not None:
            self.on_engine_dead(engine)

    def engine_died(self, rank: int, reason: str, incarnation: int = -1) -> None:
        """The supervisor's word that an engine died; about an incarnation before the
        one that has re-joined since, it is stale."""
        engine = self.engines[rank]
        if 0 <= incarnation and engine.ready and incarnation < engine.ready.incarnation:
            return
        self.mark_dead(engine, reason)

    def _fail_streams(self, engine: EngineState, error: BaseException) -> None:
        for rid, stream in list(self.requests.items()):
            if stream.engine is engine:
                del self.requests[rid]
                stream.finished = True
                stream.fail(error)
        engine.in_flight = 0

    def fail_all(self, error: BaseException) -> int:
        """End every in-flight request with `error` and abort it in its engine."""
        streams = list(self.requests.values())
        self.abort([s.request_id for s in streams])
        for stream in streams:
            stream.fail(error)
        return len(streams)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.outputs.stop()
        # Sockets first, then their ZAP handler, then the context it runs on.
        self.router.close(linger=0)
        self.pull.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)
