"""The engine's way out (engine_core/output_thread.py): the busy loop sends a small
message itself only when nothing put before it is still unsent, so messages of every size,
and the heartbeats of another thread, reach the API server in the order they were made."""

from __future__ import annotations

import threading
import types

import zmq

from engine_core.client_load import ClientLoad
from engine_core.output_thread import DIRECT_MAX_OUTPUTS, HEARTBEAT, OutputLane, run_output_thread
from protocol import codec
from protocol.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats

MESSAGES = 600


def test_small_and_large_messages_and_heartbeats_arrive_in_order(tmp_path):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/out")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{tmp_path}/out")
    # The engine process's parts the output thread reads, with the real socket and load.
    proc = types.SimpleNamespace(
        rank=0,
        outputs=[push],
        client_load=ClientLoad(1),
        stats=SchedulerStats(),
        ready=None,
        output_queue=OutputLane(),
    )
    sender = threading.Thread(target=run_output_thread, args=(proc,), daemon=True)
    sender.start()
    stop = threading.Event()

    def beats() -> None:  # as the heartbeat thread does, but every 0.2 ms
        while not stop.wait(0.0002):
            proc.output_queue.put((-1, HEARTBEAT))

    beater = threading.Thread(target=beats, daemon=True)
    beater.start()
    try:
        for i in range(MESSAGES):
            # Every third message too large to send directly: it waits in the lane, and
            # the small ones after it must not overtake it.
            size = DIRECT_MAX_OUTPUTS + 1 if i % 3 == 0 else 1
            outs = [EngineCoreOutput(f"r{i}-{k}", [i]) for k in range(size)]
            message = EngineCoreOutputs(engine_index=0, outputs=outs)
            proc.output_queue.send_or_put(proc, 0, message)
        stop.set()
        beater.join(5)
        proc.output_queue.put(None)
        sender.join(5)
        assert not sender.is_alive()
        seen: list[int] = []
        beats_seen = 0
        while pull.poll(1000):
            msg = codec.decode_outputs(pull.recv())
            if msg.outputs:
                seen.append(msg.outputs[0].new_token_ids[0])
            else:
                beats_seen += 1
        assert seen == list(range(MESSAGES))
        assert beats_seen > 0
        assert proc.output_queue.waiting == 1  # only the None that ended the thread
    finally:
        stop.set()
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
