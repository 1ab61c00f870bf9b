"""One loop turn's socket writes, sent together in one system call.

An engine step wakes every stream it advanced, and each writes its chunk. Written one
by one, each send wakes the client's reader, and a reader on this machine (a load
tool, a local gateway) preempts the writer at once, reads one chunk and sleeps again:
two context switches a token on each side. Here the writes of one loop turn are held
(in order, joined per connection) and sent at the start of the next turn in one
io_uring submission, so the readers wake once for the lot.

Only plain TCP or Unix connections are held, and only while their transport has
nothing buffered; TLS, a connection the kernel pushed back on, a large write, or a
machine without io_uring write through the transport as before. A send the kernel
takes in part, or refuses, hands the rest to the transport, which buffers it (and
applies its flow control) or meets the error itself.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from frontend.uring import SendRing, open_ring

log = logging.getLogger("zserve.api")

HOLD_BYTES = 64 * 1024  # a connection with more than this held writes through at once


class WriteBatcher:
    """The held writes of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ring: SendRing) -> None:
        self._loop = weakref.ref(loop)  # the batcher lives as long as its loop, no longer
        self.ring: SendRing | None = ring
        self._held: dict[BatchedTransport, list[bytes]] = {}
        weakref.finalize(self, ring.close)

    def hold(self, transport: BatchedTransport, data: bytes) -> None:
        if not self._held:
            self._loop().call_soon(self.flush)
        self._held[transport] = [data]
        transport.held = len(data)

    def release(self, transport: BatchedTransport) -> None:
        """Hand one connection's held bytes to its transport, in order."""
        chunks = self._held.pop(transport, None)
        transport.held = 0
        if chunks:
            transport.real.write(b"".join(chunks))

    def drop(self, transport: BatchedTransport) -> None:
        self._held.pop(transport, None)
        transport.held = 0

    def flush(self) -> None:
        held, self._held = self._held, {}
        sends, owners = [], []
        for transport, chunks in held.items():
            transport.held = 0
            if transport.real.is_closing():  # the peer left, and its socket may be closed
                continue
            sends.append((transport.fd, chunks[0] if len(chunks) == 1 else b"".join(chunks)))
            owners.append(transport)
        if not sends:
            return
        ring = self.ring
        try:
            results = ring.send_all(sends)
        except OSError as exc:  # sent, but how much is unknown: these streams are lost
            self.ring = None
            log.error("batched writes failed (%s); closing %d connections", exc, len(owners))
            for transport in owners:
                transport.real.abort()
            return
        if ring.broken:
            self.ring = None
            log.error("io_uring refused a batch of writes; writing through transports now")
        for transport, (_, data), sent in zip(owners, sends, results):
            if sent != len(data):  # in part, refused, or an error the transport will meet
                transport.real.write(data[sent:] if sent > 0 else data)


class BatchedTransport:
    """A transport whose writes go through the loop's batcher while it can hold them."""

    __slots__ = ("real", "fd", "held", "_batcher")

    def __init__(self, real: asyncio.Transport, fd: int, batcher: WriteBatcher) -> None:
        self.real = real
        self.fd = fd
        self.held = 0  # bytes held for this connection this turn
        self._batcher = batcher

    def write(self, data: bytes) -> None:
        batcher = self._batcher
        if not data:
            return
        if self.held:
            batcher._held[self].append(bytes(data))
            self.held += len(data)
            if self.held > HOLD_BYTES:
                batcher.release(self)
        elif (
            len(data) <= HOLD_BYTES
            and batcher.ring is not None
            and not self.real.get_write_buffer_size()
        ):
            batcher.hold(self, bytes(data))
        else:
            self.real.write(data)

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def get_write_buffer_size(self) -> int:
        return self.real.get_write_buffer_size() + self.held

    def close(self) -> None:
        self._batcher.release(self)
        self.real.close()

    def write_eof(self) -> None:
        self._batcher.release(self)
        self.real.write_eof()

    def abort(self) -> None:
        self._batcher.drop(self)
        self.real.abort()

    def __getattr__(self, name: str):
        return getattr(self.real, name)


_batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def batched(transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
    """`transport`, or one that batches its writes where this loop can."""
    sock = transport.get_extra_info("socket")
    if sock is None or transport.get_extra_info("sslcontext") is not None:
        return transport
    if loop not in _batchers:
        ring = open_ring()
        _batchers[loop] = WriteBatcher(loop, ring) if ring is not None else None
    batcher = _batchers[loop]
    if batcher is None:
        return transport
    return BatchedTransport(transport, sock.fileno(), batcher)
