"""The API server's output reader: a callback on the PULL socket's descriptor, which
ZMQ signals only on changes. Every queued message must reach its stream, whatever sits
between them on the wire, and a backlog must not hold the event loop in one turn."""

from __future__ import annotations

import asyncio
import time

import zmq

from frontend.engine_client import EngineClient
from frontend.engine_state import ClientConfig, RequestStream
from frontend.output_reader import MESSAGES_PER_TURN
from protocol import codec
from protocol.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason

BACKLOG = 10 * MESSAGES_PER_TURN


def test_a_backlog_of_outputs_reaches_every_stream_a_turn_at_a_time(tmp_path):
    async def scenario() -> tuple[list[RequestStream], list[int]]:
        client = EngineClient(
            ClientConfig(
                client_index=0,
                num_engines=1,
                input_address=f"ipc://{tmp_path}/in",
                output_address=f"ipc://{tmp_path}/out",
            )
        )
        engine = client.engines[0]
        streams = [RequestStream(f"r{i}", engine) for i in range(BACKLOG)]
        for s in streams:
            client.requests[s.request_id] = s
            engine.in_flight += 1
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(client.output_address)
        for i, s in enumerate(streams):
            if i % 7 == 0:  # hostile or broken messages between them change nothing
                push.send(b"\xc1 not msgpack")
                push.send_multipart([b"three", b"frames", b"here"])
            out = EngineCoreOutput(s.request_id, [i], finish_reason=FinishReason.LENGTH)
            message = codec.encode(EngineCoreOutputs(engine_index=0, outputs=[out]))
            if i + 1 < BACKLOG:
                push.send(message)
        deadline = time.monotonic() + 5
        while client.pull.poll(0) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # let libzmq's I/O thread queue the rest
        # The last message arrives after that poll took the descriptor's signal, so the
        # reader starts with the descriptor readable as well as its first look queued
        # (as when outputs arrive while it starts): still one turn at a time.
        push.send(message)
        push.close(linger=-1)
        ctx.term()  # returns once every message is handed to the receiving side

        seen: list[int] = []  # streams finished, at each turn of another coroutine

        async def watch() -> None:
            while len(seen) < 2 or seen[-1] < BACKLOG:
                seen.append(sum(s.finished for s in streams))
                await asyncio.sleep(0)

        client.outputs.start()
        try:
            await asyncio.wait_for(watch(), 10)
        finally:
            client.close()
        assert not client.requests and engine.in_flight == 0
        return streams, seen

    streams, seen = asyncio.run(scenario())
    assert [s.items[0].new_token_ids for s in streams] == [[i] for i in range(BACKLOG)]
    # The loop ran other work between turns of at most MESSAGES_PER_TURN each.
    steps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert max(steps) <= MESSAGES_PER_TURN
    assert sum(0 < n < BACKLOG for n in seen) >= BACKLOG // MESSAGES_PER_TURN - 1
