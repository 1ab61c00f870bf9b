"""CPU a message costs an asyncio (uvloop) process to receive from a ZMQ PULL, two ways:
`await socket.recv_multipart()` through zmq.asyncio, and a callback on the socket's
descriptor that reads with NOBLOCK (frontend/engine_client.py's output reader).

A sender process pushes 120-byte messages with a pause after each (GAP_US, default 300:
one message per wake-up, as a single stream's tokens arrive) or none (0: a backlog).
Printed: the receiver's process CPU (all its threads, libzmq's I/O thread included)
per message.

    python benchmarks/scripts/zmq_receive_cost.py asyncio|reader [GAP_US]
"""

import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time

import uvloop
import zmq
import zmq.asyncio

MESSAGES = 20_000


def sender(address: str, gap_us: float) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    time.sleep(0.3)
    payload = b"x" * 120
    for _ in range(MESSAGES):
        sock.send(payload)
        until = time.perf_counter() + gap_us / 1e6
        while time.perf_counter() < until:
            pass
    sock.send(b"")  # the end
    sock.close(linger=-1)
    ctx.term()


async def via_asyncio(address: str, gap_us: float) -> float:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    proc = mp.Process(target=sender, args=(address, gap_us))
    proc.start()
    start = None
    while True:
        frames = await sock.recv_multipart(copy=False)
        start = time.process_time() if start is None else start
        if not len(frames[0].buffer):
            break
    cpu = time.process_time() - start
    proc.join()
    sock.close()
    ctx.term()
    return cpu


async def via_reader(address: str, gap_us: float) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    proc = mp.Process(target=sender, args=(address, gap_us))
    proc.start()
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    start = []

    def on_readable() -> None:
        # The descriptor is edge-triggered: read until empty.
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            start or start.append(time.process_time())
            if not len(frames[0].buffer):
                done.set_result(time.process_time() - start[0])
                return

    fd = sock.getsockopt(zmq.FD)
    loop.add_reader(fd, on_readable)
    loop.call_soon(on_readable)
    cpu = await done
    loop.remove_reader(fd)
    proc.join()
    sock.close()
    ctx.term()
    return cpu


def main() -> None:
    mode = sys.argv[1]
    gap_us = float(sys.argv[2]) if len(sys.argv) > 2 else 300.0
    address = f"ipc://{os.path.join(tempfile.mkdtemp(), 'pull')}"
    receive = via_asyncio if mode == "asyncio" else via_reader
    cpu = uvloop.run(receive(address, gap_us))
    print(f"{mode:8s} gap {gap_us:g} us: {cpu / MESSAGES * 1e6:.1f} us of CPU a message")


if __name__ == "__main__":
    main()
