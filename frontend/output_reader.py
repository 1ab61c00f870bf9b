"""The API server's reader of engine outputs: a callback on the PULL socket's descriptor.

It decodes each message the engines send and routes each output to the stream of its
request, each utility result to its waiter, each heartbeat's figures to its engine.

A receive through zmq.asyncio costs a future and a task wake-up a message. At one token a
message (a single stream) that was twice the CPU of this reader: 80–99 against 37–44 us a
message (benchmarks/scripts/zmq_receive_cost.py, BENCHMARKS.md §4).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import zmq

from protocol import codec
from protocol.messages import ENGINE_CORE_DEAD
from protocol.sockets import identity_rank

if TYPE_CHECKING:
    from frontend.engine_client import EngineClient

log = logging.getLogger("zserve.client")

# Messages the reader takes in one turn of the event loop before it lets the loop's other
# work run (it comes back on the next turn).
MESSAGES_PER_TURN = 64


class OutputReader:
    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.pull = client.pull
        self._reader: tuple[asyncio.AbstractEventLoop, int] | None = None
        # A turn is queued with call_soon: the descriptor's own callback then leaves the
        # socket to it, so the messages are read by one chain of turns, not two.
        self._queued = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        fd = self.pull.getsockopt(zmq.FD)
        loop.add_reader(fd, self.on_readable)
        self._reader = (loop, fd)
        # Messages may have queued before the reader was added, and ZMQ's descriptor
        # signals only changes: look once now.
        self._queue_turn(loop)

    def stop(self) -> None:
        if self._reader is not None:
            loop, fd = self._reader
            self._reader = None
            if not loop.is_closed():
                loop.remove_reader(fd)

    def on_readable(self) -> None:
        """Hot path. ZMQ's descriptor is edge-triggered: once it fires, every queued
        message must be taken, or the rest waits for the next message to arrive. So this
        reads until the socket is empty, and after MESSAGES_PER_TURN messages it goes on
        in the loop's next turn rather than hold the loop."""
        if self._queued:  # a queued turn reads on (two turns would run per loop pass)
            return
        pull = self.pull
        for _ in range(MESSAGES_PER_TURN):
            try:
                # Asking first is cheaper than the exception of an empty receive.
                if not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:  # closed under us (close() is under way), or Again
                log.debug("output socket: %s", e)
                return
            try:
                self.on_message(frames)
            except Exception:  # a bug here must not stop the outputs of every request
                log.exception("failed to handle an output message")
        if self._reader is not None:
            self._queue_turn(self._reader[0])

    def _queue_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        self._queued = True
        loop.call_soon(self._queued_turn)

    def _queued_turn(self) -> None:
        self._queued = False
        self.on_readable()

    def on_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 1:
            self.special_message(frames)
            return
        client = self.client
        try:
            outs = codec.decode_outputs(frames[0].buffer)
            engine = client.engines[outs.engine_index]
        except (*codec.DecodeError, IndexError) as e:
            log.warning("dropped an undecodable output message: %s", e)
            return
        now = time.monotonic()
        engine.last_seen = now
        stats = outs.scheduler_stats
        if stats is not None:
            prev = engine.stats
            if stats.num_steps != prev.num_steps or stats.num_waits != prev.num_waits:
                engine.steps_changed_at = now
            if stats.cpu_s:
                engine.heard_cpu(stats.cpu_s, now)
            engine.blocked_until = now + stats.blocked_s if stats.blocked_s else 0.0
            engine.stats = stats
        requests = client.requests
        for out in outs.outputs:
            stream = requests.get(out.request_id)
            if stream is None:
                continue  # aborted here already, or not ours
            stream.put(out)
            if out.finish_reason is not None:
                del requests[out.request_id]
                stream.finished = True
                engine.in_flight -= stream.weight
        if outs.utility_result is not None:
            waiter = client.utility_waiters.get(outs.utility_result.call_id)
            if waiter is not None and not waiter.done():
                r = outs.utility_result
                if r.failure_message:
                    waiter.set_exception(RuntimeError(r.failure_message))
                else:
                    waiter.set_result(r.result)

    def special_message(self, frames: list[zmq.Frame]) -> None:
        """[ENGINE_CORE_DEAD, rank]: an engine's last words before it exits."""
        if len(frames) == 2 and bytes(frames[0].buffer) == ENGINE_CORE_DEAD:
            rank = identity_rank(bytes(frames[1].buffer))
            if 0 <= rank < len(self.client.engines):
                self.client.mark_dead(
                    self.client.engines[rank], "the engine reported a fatal error"
                )
                return
        log.warning("dropped a %d-frame message on the output socket", len(frames))
