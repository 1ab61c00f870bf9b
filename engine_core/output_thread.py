"""An engine's output thread: it alone sends to the API servers (ZMQ sockets are not
thread-safe), encoding while the busy loop runs the next forward."""

from __future__ import annotations

import copy
import logging
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


def run_output_thread(proc: EngineCoreProc) -> None:
    """The output thread: owns the PUSH sockets; everything bound for an API server goes
    through proc.output_queue, (client_index, message) or one of the markers above."""
    while True:
        item = proc.output_queue.get()
        if item is None:
            return
        client_index, message = item
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
