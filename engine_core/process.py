"""The engine-core process: handshake, then three threads around one EngineCore.

    input thread   DEALER per API server → decode → input queue
    busy loop      drain inputs → step → queue outputs → publish load   (owns torch)
    output thread  output queue → encode → PUSH to sockets[client_index]   (output_thread.py)

The handshake and the sockets are engine_links.py's, the utility calls utility_calls.py's;
what each API server hears of this engine's load, and when, is client_load.py's.

ZMQ and msgpack release the GIL, so encoding and sending step N's outputs overlap
the forward of step N+1.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine_core.client_load import HEARTBEAT_S, STATS_INTERVAL_S, ClientLoad, load_key
from engine_core.config import EngineProcConfig
from engine_core.device import release_free_memory
from engine_core.engine_links import (
    await_plan,
    connect_links,
    open_handshake,
    ready_announcement,
)
from engine_core.output_thread import DEAD, HEARTBEAT, LOAD, OutputLane, run_output_thread
from engine_core.utility_calls import dispatch, failure_message
from protocol import codec
from protocol.handshake import EnginePlan, encode_handshake
from protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    RequestType,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
    api_request_id,
    error_output,
)
from protocol.process_life import on_signals_in_a_thread

log = logging.getLogger("zserve.engine")

RELEASE_MEMORY_S = 2.0  # at most this often, and only once idle
SEND_WAIT_S = 5.0  # push_state(blocked_s): how long to wait for the output thread


class _Shutdown(Exception):
    pass


_CLIENT_GONE = object()  # input-queue kind: an API server went away


class EngineCoreProc:
    """One engine core and its sockets; `run()` blocks until shutdown."""

    def __init__(self, cfg: EngineProcConfig) -> None:
        self.cfg = cfg
        self.rank = cfg.rank
        self.ctx = zmq.Context(io_threads=1)
        self.inputs: list[zmq.Socket] = []
        self.outputs: list[zmq.Socket] = []
        # Not a SimpleQueue: before 3.13 its get(timeout) can hang for good on a signal.
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue = OutputLane()
        self.stop = threading.Event()
        self.loading = False  # in load(): the model, the KV cache, the warm-up
        self.engine = None
        self.ready: EngineReady | None = None
        self.stats = SchedulerStats()
        self.owners: dict[str, int] = {}  # request id -> client index, for _CLIENT_GONE
        self.weights: dict[str, int] = {}  # request id -> sequences, where more than one
        self.client_load = ClientLoad(0)  # sized for the API servers by connect()
        self.controls = None  # EngineControls, once the model is loaded
        self._release_due, self._released_at = False, 0.0

    # --- start-up -----------------------------------------------------------------

    def handshake(self) -> EnginePlan:
        """HELLO → PLAN (engine_links.py); the socket stays for READY."""
        self.handshake_socket = open_handshake(self.ctx, self.cfg, self.rank)
        plan = await_plan(self.handshake_socket, self.cfg, self.rank, self.stop)
        if plan is None:
            raise _Shutdown()
        return plan

    def connect(self, plan: EnginePlan) -> None:
        self.inputs, self.outputs = connect_links(self.ctx, self.cfg, self.rank, plan)
        self.client_load = ClientLoad(len(self.outputs))

    def take_lora_settings(self, plan: EnginePlan) -> None:
        """The head's LoRA settings are the server's: every engine, a headless one too,
        serves the same adapters (a headless node's own LoRA flags give way)."""
        own = self.cfg.engine.lora
        if plan.lora != own:
            if self.cfg.headless and own is not None:
                log.warning("engine %d: the head's LoRA settings replace this node's", self.rank)
            self.cfg.engine.lora = plan.lora

    def load(self) -> None:
        from engine_core.controls import EngineControls
        from engine_core.engine import EngineCore

        self.engine = EngineCore(self.cfg.engine)
        self.controls = EngineControls(self, self.engine, self.cfg.engine.profiler)
        self.ready = ready_announcement(self.engine, self.cfg)

    def announce(self) -> None:
        """READY to the supervisor; the API servers hear from the input thread."""
        self.handshake_socket.send(encode_handshake("ready", self.ready))

    # --- threads ------------------------------------------------------------------

    def input_thread(self) -> None:
        """Owns the DEALER sockets. Each (re)connection to an API server gets our
        announcement (the ROUTER send-first rule: a restarted API server must hear
        from us before it can address us); a disconnection aborts that API server's
        requests, whose streams died with it."""
        announcement = codec.encode(self.ready)
        poller = zmq.Poller()
        monitors: dict[zmq.Socket, int] = {}
        for index, sock in enumerate(self.inputs):
            poller.register(sock, zmq.POLLIN)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            poller.register(monitor, zmq.POLLIN)
            monitors[monitor] = index
            sock.send(announcement)
        try:
            while not self.stop.is_set():
                added = False
                for sock, _ in poller.poll(100):
                    index = monitors.get(sock)
                    if index is not None:
                        self._on_connection_event(index, sock, announcement)
                        continue
                    frames = sock.recv_multipart(copy=True)
                    try:
                        kind, payload = codec.decode_request(frames)
                    except codec.DecodeError as e:
                        log.warning("engine %d: dropped an undecodable request: %s", self.rank, e)
                        continue
                    if kind is RequestType.ADD and self.client_load.count_in(
                        payload.client_index, payload.num_sequences
                    ):
                        added = True
                    self.input_queue.put((kind, payload))
                if added:
                    self.queue_load_update()
        finally:
            for sock in self.inputs:
                sock.disable_monitor()
            for monitor in monitors:
                monitor.close(linger=0)

    def _on_connection_event(self, index: int, monitor: zmq.Socket, announcement: bytes) -> None:
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_CONNECTED:
            self.inputs[index].send(announcement)
        elif event == zmq.EVENT_DISCONNECTED:
            log.info(
                "engine %d: API server %d disconnected; aborting its requests", self.rank, index
            )
            self.input_queue.put((_CLIENT_GONE, index))

    def queue_load_update(self) -> None:
        """Ask the output thread to tell the API servers of a change in their load
        (at most one such request waits in its queue)."""
        if self.client_load.claim_update():
            self.output_queue.put((-1, LOAD))

    def heartbeat_thread(self) -> None:
        """Liveness for every API server, whatever the busy loop does. The stats it
        carries include the step counter, so a hung loop is visible too."""
        while not self.stop.wait(HEARTBEAT_S):
            self.output_queue.put((-1, HEARTBEAT))

    # --- the busy loop ------------------------------------------------------------

    def handle_input(self, kind, payload) -> None:
        engine = self.engine
        if kind is RequestType.ADD:
            req: EngineCoreRequest = payload
            errors = self.controls.refusal(req) or engine.add_request(req)
            if errors:
                self.client_load.settle(req.client_index, req.num_sequences)
                self.queue_outputs_for(req.client_index, errors)
            else:
                self.owners[req.request_id] = req.client_index
                if req.num_sequences > 1:
                    self.weights[req.request_id] = req.num_sequences
        elif kind is RequestType.ABORT:
            engine.abort_requests(payload)
            for rid in payload:
                self._forget(rid)
        elif kind is _CLIENT_GONE:
            # If that API server is alive after all (a dropped TCP link), its streams
            # end with an error once the link is back instead of hanging forever.
            gone = [rid for rid, owner in self.owners.items() if owner == payload]
            self.end_requests(
                gone, FinishReason.ERROR, "the engine lost its link to this API server"
            )
        else:
            self.call_utility(payload)

    def _forget(self, request_id: str) -> None:
        owner = self.owners.pop(request_id, None)
        if owner is not None:
            weight = self.weights.pop(request_id, 1) if self.weights else 1
            self.client_load.settle(owner, weight)

    def _make_stats(self) -> SchedulerStats:
        stats = self.engine.make_stats()
        stats.num_requests_by_client = self.client_load.by_client()
        stats.sleep_level = self.controls.sleep_mode.level
        stats.paused = self.controls.paused
        stats.generation_hold = self.engine.scheduler.hold or ""
        return stats

    def push_state(self, blocked_s: float = 0.0) -> None:
        """Every API server hears this engine's state now, not at the next heartbeat; with
        `blocked_s` (the loop is about to block that long), once it has been sent."""
        self.stats = self._make_stats()
        self.stats.blocked_s = blocked_s
        self.output_queue.put((-1, HEARTBEAT))
        if blocked_s:
            sent = threading.Event()
            self.output_queue.put((-1, sent))
            sent.wait(SEND_WAIT_S)

    def end_all_requests(self, message: str) -> int:
        """End every request of this engine with an UNAVAILABLE error (a 503)."""
        return self.end_requests(list(self.owners), FinishReason.UNAVAILABLE, message)

    def abort_api_requests(self, api_ids: list[str]) -> list[str]:
        """End the engine requests of these API requests, whichever API server sent
        them, as aborted; which of the ids this engine had."""
        wanted = set(api_ids)
        ids = [rid for rid in self.owners if api_request_id(rid) in wanted]
        self.end_requests(ids, FinishReason.ABORT, "aborted by POST /inference/v1/abort_requests")
        return sorted({api_request_id(rid) for rid in ids})

    def end_requests(self, ids: list[str], reason: FinishReason, message: str) -> int:
        """End these requests, each owner hearing `reason` with `message`."""
        by_client: dict[int, list[str]] = {}
        for rid in ids:
            by_client.setdefault(self.owners[rid], []).append(rid)
        self.engine.abort_requests(ids)
        for rid in ids:
            self._forget(rid)
        for client_index, rids in by_client.items():
            self.queue_outputs_for(
                client_index, [error_output(rid, message, reason) for rid in rids]
            )
        return len(ids)

    def call_utility(self, call: UtilityCall) -> None:
        # The caller's client index travels as the first argument.
        client_index, *args = call.args or [0]

        def reply(value: object = None, failure: str | None = None) -> None:
            self._reply_utility(int(client_index), UtilityResult(call.call_id, value, failure))

        try:
            dispatch(call.method, args, self.engine, self.controls, reply)
        except Exception as e:  # a failed utility call must not kill the engine
            log.warning("engine %d: utility %s failed: %s", self.rank, call.method, e)
            reply(failure=failure_message(e))

    def _reply_utility(self, client_index: int, result: UtilityResult) -> None:
        self.output_queue.put(
            (
                client_index,
                EngineCoreOutputs(
                    engine_index=self.rank,
                    scheduler_stats=self._make_stats(),
                    timestamp=time.time(),
                    utility_result=result,
                ),
            )
        )

    def queue_outputs_for(self, client_index: int, outputs: list[EngineCoreOutput]) -> None:
        """One message for an API server (outputs, or none: stats only), with the last
        stats: sent now if small and nothing waits before it, else by the output thread."""
        message = EngineCoreOutputs(
            engine_index=self.rank,
            outputs=outputs,
            scheduler_stats=self.stats,
            timestamp=time.time(),
        )
        self.output_queue.send_or_put(self, client_index, message)

    def busy_loop(self) -> None:
        """drain inputs → step → queue outputs → publish load, until shutdown."""
        self.stats: SchedulerStats = self._make_stats()
        while not self.stop.is_set():
            self.drain_inputs()
            outputs = self._step() if self._has_work() else {}
            self.queue_outputs(outputs)
            self.controls.after_step()
            self.publish_load()

    def _has_work(self) -> bool:
        # Asleep, the engine keeps its requests (mode keep) but cannot step them.
        return self.engine.has_unfinished_requests() and not self.controls.asleep

    def _step(self) -> dict[int, list[EngineCoreOutput]]:
        if self.controls.profiling:
            with self.controls.profiler.step_range():
                return self.engine.step()
        return self.engine.step()

    def drain_inputs(self) -> None:
        """Handle every input waiting. While idle, first wait for one, at most
        STATS_INTERVAL_S (so load is still published), and give memory back."""
        if self._has_work():
            self._release_due = True
        else:
            self._release_idle_memory()
            try:
                self.handle_input(*self.input_queue.get(timeout=STATS_INTERVAL_S))
            except queue.Empty:
                pass
        while True:
            try:
                self.handle_input(*self.input_queue.get_nowait())
            except queue.Empty:
                return

    def _release_idle_memory(self) -> None:
        # The step path keeps freed memory for the next step (device.keep_freed_memory);
        # idle, a burst's peak goes back to the OS, at most every RELEASE_MEMORY_S.
        if self._release_due and time.monotonic() - self._released_at >= RELEASE_MEMORY_S:
            release_free_memory()
            self._release_due, self._released_at = False, time.monotonic()

    def queue_outputs(self, outputs: dict[int, list[EngineCoreOutput]]) -> None:
        """Settle the step's finished requests, take its stats, and queue each API
        server's outputs with them."""
        for outs in outputs.values():
            for out in outs:
                if out.finish_reason is not None:
                    self._forget(out.request_id)
        self.stats = self._make_stats()
        key, now = load_key(self.stats), time.monotonic()
        for client_index, outs in outputs.items():
            self.queue_outputs_for(client_index, outs)
            self.client_load.heard(client_index, key, now)

    def publish_load(self) -> None:
        """The API servers that had no outputs hear of a change in load at most every
        STATS_INTERVAL_S; of settled requests, each whose count is stale hears at once."""
        for client_index in self.client_load.stats_due(load_key(self.stats), time.monotonic()):
            self.queue_outputs_for(client_index, [])
        if self.client_load.settled_since_publish():
            self.queue_load_update()

    # --- lifecycle ----------------------------------------------------------------

    def run(self) -> int:
        threads: list[threading.Thread] = []
        try:
            plan = self.handshake()
            self.connect(plan)
            self.take_lora_settings(plan)
            self.loading = True  # before the line: a SIGTERM sent on reading it exits at once
            log.info("engine %d: loading %s", self.rank, self.cfg.engine.model)
            try:
                self.load()
            finally:
                self.loading = False  # a failed load exits with its own code
            gc.collect()
            gc.freeze()  # the model and the libraries' objects never need scanning again
            threads = [
                threading.Thread(target=self.input_thread, name="engine-input", daemon=True),
                threading.Thread(
                    target=run_output_thread, args=(self,), name="engine-output", daemon=True
                ),
                threading.Thread(target=self.heartbeat_thread, name="engine-beat", daemon=True),
            ]
            for t in threads:
                t.start()
            self.announce()
            log.info(
                "engine %d ready: %s on %s, %d KV blocks of %d tokens, max_model_len %d",
                self.rank,
                self.ready.dtype,
                self.ready.device,
                self.ready.num_kv_blocks,
                self.ready.block_size,
                self.ready.max_model_len,
            )
            self.busy_loop()
            return 0
        except _Shutdown:
            return 0
        except Exception:
            log.exception("engine %d failed", self.rank)
            self.output_queue.put((-1, DEAD))
            return 1
        finally:
            self.stop.set()
            self.output_queue.put(None)
            # One deadline for all the threads, so a stuck one costs 5 s, not 5 s each.
            deadline = time.monotonic() + 5.0
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            stuck = [t.name for t in threads if t.is_alive()]
            if stuck:
                log.warning("engine %d: %s still running at exit", self.rank, ", ".join(stuck))
            self.ctx.destroy(linger=500)


def run_engine_core(cfg: EngineProcConfig) -> int:
    """Process entry point of one engine core (spawned by the supervisor or headless),
    once the launcher has set the process up (launcher/child_main.py)."""
    proc = EngineCoreProc(cfg)

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if proc.loading:
            # A load can take minutes and checks for nothing; the process holds nothing
            # yet that needs closing (its sockets die with it), so end it now rather than
            # make the supervisor wait its grace out and kill it.
            log.info("engine %d: %s while loading the model; exiting", cfg.rank, name)
            os._exit(0)
        if not proc.stop.is_set():
            log.info("engine %d: %s, shutting down", cfg.rank, name)
        proc.stop.set()

    on_signals_in_a_thread((signal.SIGTERM, signal.SIGINT), on_signal)
    return proc.run()
