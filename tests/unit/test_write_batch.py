"""Batched writes (frontend/uring.py, frontend/write_batch.py) on real sockets and a real
uvloop loop, as the API server runs them: every byte arrives once and in order, held
writes leave at the next loop turn, and whatever io_uring cannot take goes through the
transport."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
import uvloop

from frontend import write_batch
from frontend.uring import SendRing, open_ring
from frontend.write_batch import HOLD_BYTES, BatchedTransport, batched

pytestmark = pytest.mark.timeout(60)

ring = open_ring()
needs_ring = pytest.mark.skipif(ring is None, reason="io_uring is not allowed here")


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return server, client


def read_all(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(10)
    got = b""
    while len(got) < n:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        got += chunk
    return got


def drain(sock: socket.socket) -> bytes:
    """What the kernel holds for `sock` now, in its buffers and its peer's."""
    sock.setblocking(False)
    got = b""
    for _ in range(5):  # the kernel frees the peer's send buffer as the ACKs come back
        while True:
            try:
                got += sock.recv(1 << 20)
            except BlockingIOError:
                break
        time.sleep(0.05)
    return got


@needs_ring
def test_one_submission_sends_to_each_socket_and_reports_each_result():
    pairs = [tcp_pair() for _ in range(3)]
    a, b = socket.socketpair()
    b.close()  # a peer that left
    full, full_peer = tcp_pair()
    while True:  # fill the kernel's buffers until a send would block
        try:
            full.send(b"x" * 65536)
        except BlockingIOError:
            break
    sends = [(s.fileno(), b"chunk %d" % i) for i, (s, _) in enumerate(pairs)]
    sends += [(a.fileno(), b"gone"), (full.fileno(), b"more"), (a.fileno() + 1000, b"x")]
    results = ring.send_all(sends)
    assert results[:3] == [7, 7, 7]
    assert results[3:] == [-32, -11, -9]  # EPIPE, EAGAIN (never waited for), EBADF
    assert [c.recv(100) for _, c in pairs] == [b"chunk 0", b"chunk 1", b"chunk 2"]
    for s in [a, full, full_peer, *(x for p in pairs for x in p)]:
        s.close()


@needs_ring
def test_a_batch_larger_than_the_ring_goes_in_several_submissions():
    small = SendRing(entries=4)
    pairs = [tcp_pair() for _ in range(10)]
    try:
        results = small.send_all([(s.fileno(), b"%02d" % i) for i, (s, _) in enumerate(pairs)])
        assert results == [2] * 10 and not small.broken
        assert [c.recv(10) for _, c in pairs] == [b"%02d" % i for i in range(10)]
    finally:
        small.close()
        for s in (x for p in pairs for x in p):
            s.close()


class Sink(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport


async def served(loop) -> tuple[BatchedTransport, socket.socket, asyncio.AbstractServer]:
    """A server-side transport on this loop, batched as the API server's are."""
    made = loop.create_future()

    class Made(Sink):
        def connection_made(self, transport):
            made.set_result(batched(transport, loop))

    server = await loop.create_server(Made, "127.0.0.1", 0)
    client = socket.create_connection(server.sockets[0].getsockname())
    return await made, client, server


LOOPS = [uvloop.new_event_loop, asyncio.new_event_loop]  # the server's, and asyncio's own


def run_on(new_loop, test) -> None:
    loop = new_loop()
    try:
        loop.run_until_complete(test(loop))
    finally:
        loop.close()


@needs_ring
@pytest.mark.parametrize("new_loop", LOOPS)
def test_one_turns_writes_leave_together_at_the_next_turn_in_order(new_loop):
    async def test(loop):
        streams = [await served(loop) for _ in range(4)]
        for t, _, _ in streams:
            assert isinstance(t, BatchedTransport)
        for i in range(3):
            for n, (t, _, _) in enumerate(streams):
                t.write(b"s%d-c%d;" % (n, i))
        for _, client, _ in streams:  # held: nothing has left yet
            client.setblocking(False)
            with pytest.raises(BlockingIOError):
                client.recv(100)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        for n, (t, client, server) in enumerate(streams):
            client.setblocking(True)
            assert read_all(client, 18) == b"s%d-c0;s%d-c1;s%d-c2;" % (n, n, n)
            assert t.get_write_buffer_size() == 0
            t.close()
            server.close()
            client.close()

    run_on(new_loop, test)


@needs_ring
@pytest.mark.parametrize("new_loop", LOOPS)
def test_what_the_kernel_does_not_take_goes_through_the_transport_in_order(new_loop):
    async def test(loop):
        t, client, server = await served(loop)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        expected, buffered = b"", 0
        for i in range(40):  # each below the hold limit; together far above the buffers
            chunk = bytes([65 + i % 26]) * 50_000
            t.write(chunk)
            expected += chunk
            if i % 3 == 0:
                await asyncio.sleep(0)
                buffered = max(buffered, t.real.get_write_buffer_size())
        assert buffered  # sends the kernel took in part: the rest went to the transport
        await asyncio.sleep(0)
        assert t.real.get_write_buffer_size()  # the client has read nothing yet
        head = drain(client)  # the socket empties; the transport is not told
        t.write(b"marker")  # must queue behind what the transport holds, not jump it
        await asyncio.sleep(0)
        expected += b"marker"
        big = b"z" * (HOLD_BYTES + 1)  # written through, after what is held
        t.write(big)
        expected += big
        rest = await loop.run_in_executor(None, read_all, client, len(expected) - len(head))
        assert head + rest == expected
        t.close()
        server.close()
        client.close()

    run_on(new_loop, test)


@needs_ring
@pytest.mark.parametrize("new_loop", LOOPS)
def test_close_sends_what_is_held_first_and_abort_drops_it(new_loop):
    async def test(loop):
        t, client, server = await served(loop)
        t.write(b"last words")
        t.close()
        await asyncio.sleep(0.05)
        assert read_all(client, 100) == b"last words"  # then the end of the stream
        t2, client2, server2 = await served(loop)
        t2.write(b"never sent")
        t2.abort()
        await asyncio.sleep(0.05)
        client2.settimeout(5)
        try:
            assert client2.recv(100) == b""
        except ConnectionResetError:
            pass
        for x in (server, server2, client, client2):
            x.close()

    run_on(new_loop, test)


@needs_ring
@pytest.mark.parametrize("new_loop", LOOPS)
def test_a_ring_that_fails_hands_the_batch_to_the_transports_and_is_not_used_again(new_loop):
    async def test(loop):
        t, client, server = await served(loop)
        batcher = write_batch._batchers[loop]
        real_fd = batcher.ring.fd
        batcher.ring.fd = -1  # io_uring_enter now answers EBADF and takes nothing
        try:
            t.write(b"first;")
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert batcher.ring is None
            t.write(b"second;")  # straight to the transport now
            assert read_all(client, 13) == b"first;second;"
        finally:
            write_batch._batchers.pop(loop)
            os.close(real_fd)
        t.close()
        server.close()
        client.close()

    run_on(new_loop, test)


def test_tls_and_transports_without_a_socket_are_left_alone():
    loop = asyncio.new_event_loop()
    with socket.socket() as sock:

        class NoSocket(asyncio.Transport):
            def get_extra_info(self, name, default=None):
                return default

        class Tls(asyncio.Transport):
            def get_extra_info(self, name, default=None):
                return {"socket": sock, "sslcontext": object()}.get(name, default)

        for transport in (NoSocket(), Tls()):
            assert batched(transport, loop) is transport
    loop.close()
