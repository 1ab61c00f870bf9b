"""An engine's output thread: it sends to the API servers, encoding while the busy loop
runs the next forward. A small message the busy loop sends itself, when nothing waits
before it (OutputLane)."""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from protocol import codec
from protocol.messages import ENGINE_CORE_DEAD, EngineCoreOutputs
from protocol.sockets import rank_identity

if TYPE_CHECKING:
    from engine_core.process import EngineCoreProc

log = logging.getLogger("zserve.engine")

# Output-queue markers: the latest stats to every API server (liveness); this engine is
# dying; tell each API server of a change in the others' load.
HEARTBEAT = object()
DEAD = object()
LOAD = object()


# A message of at most this many outputs goes out from the busy loop itself when nothing
# waits before it in the lane. Handing it to the output thread cost ~90 us of CPU and three
# context switches a message (one stream, on the CPU, where the step holds every core);
# encoding 32 outputs costs 3.5 us (BENCHMARKS.md §4).
DIRECT_MAX_OUTPUTS = 32


class OutputLane:
    """The way out to the API servers, in order. Every thread puts what it has; the busy
    loop may send a small message itself, but only when every message put before it has
    been sent. `lock` guards the sockets (ZMQ sockets are not thread-safe) and `waiting`."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.waiting = 0  # put and not yet sent

    def put(self, item) -> None:
        """(client_index, message), one of the markers above, or None: the thread ends."""
        with self.lock:
            self.waiting += 1
            self.queue.put(item)

    def send_or_put(self, proc: EngineCoreProc, client_index: int, message) -> None:
        with self.lock:
            if not self.waiting and len(message.outputs) <= DIRECT_MAX_OUTPUTS:
                _send(proc, client_index, message)
                return
            self.waiting += 1
            self.queue.put((client_index, message))


def run_output_thread(proc: EngineCoreProc) -> None:
    """The output thread: sends everything put in proc.output_queue (an OutputLane)."""
    lane: OutputLane = proc.output_queue
    while True:
        item = lane.queue.get()
        if item is None:
            return
        with lane.lock:
            _send(proc, *item)
            lane.waiting -= 1


def _send(proc: EngineCoreProc, client_index: int, message) -> None:
    """Send one item of the lane; the caller holds its lock."""
    if message is HEARTBEAT:
        stats = proc.stats
        if proc.ready is not None and proc.ready.device == "cpu":  # see SchedulerStats
            stats = msgspec.structs.replace(stats, cpu_s=time.process_time())
        message = EngineCoreOutputs(
            engine_index=proc.rank, scheduler_stats=stats, timestamp=time.time()
        )
        data = codec.encode(message)
        for index, sock in enumerate(proc.outputs):
            proc.client_load.note_told(index, message.scheduler_stats)
            sock.send(data, copy=False)
    elif message is LOAD:
        _send_load_updates(proc)
    elif isinstance(message, threading.Event):  # what was queued before it is sent
        message.set()
    elif message is DEAD:
        for sock in proc.outputs:
            sock.send_multipart([ENGINE_CORE_DEAD, rank_identity(proc.rank)])
    elif 0 <= client_index < len(proc.outputs):
        if message.scheduler_stats is not None:
            proc.client_load.note_told(client_index, message.scheduler_stats)
        proc.outputs[client_index].send(codec.encode(message), copy=False)
    else:
        log.warning("engine %d: output for unknown client %d", proc.rank, client_index)


def _send_load_updates(proc: EngineCoreProc) -> None:
    """Each API server whose view of the other servers' requests
    here is out of date hears the current counts, with the last stats."""
    by_client = proc.client_load.begin_update()
    stats = None
    for index, sock in enumerate(proc.outputs):
        if not proc.client_load.is_stale(index, by_client):
            continue
        if stats is None:
            stats = copy.copy(proc.stats)  # the busy loop's, as it was last made
            stats.num_requests_by_client = by_client
            data = codec.encode(
                EngineCoreOutputs(
                    engine_index=proc.rank, scheduler_stats=stats, timestamp=time.time()
                )
            )
        proc.client_load.note_told(index, stats)
        sock.send(data, copy=False)
