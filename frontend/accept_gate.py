"""Backpressure at the open-files limit: stop accepting connections a little below it,
and accept again once enough have closed.

Every connection holds a file descriptor. When accept() fails with EMFILE, libuv (under
uvloop) sheds load by accepting each waiting connection and closing it at once, so the
clients get resets, and nothing is logged. The gate stops accepting before that: new
connections wait in the kernel's listen backlog (their clients see a slower answer, not
an error), one warning says why and which limit, and accepting resumes when the count
has dropped by a tenth.

uvicorn serves on a duplicate of the listening socket, which is closed to stop
accepting; the original stays open and listening, so the kernel keeps queueing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import resource
import socket

import uvicorn

log = logging.getLogger("zserve.api")


def connection_cap(reserve_fraction: float = 1 / 16, min_reserve: int = 64) -> int:
    """How many connections this process can hold: the soft open-files limit, less what
    is open now (sockets to the engines, the tokenizer workers' pipes, metrics files)
    and a reserve for what opens later (and for TLS handshakes, counted only once done)."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        limit = 1 << 20
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    reserve = max(min_reserve, int(limit * reserve_fraction))
    return max(1, limit - in_use - reserve)


class AcceptGate:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.resume_at = max(0, cap - max(1, cap // 10))
        self.open = 0
        self.paused = False
        self.server: uvicorn.Server | None = None
        self.listener: socket.socket | None = None
        self.reopening: asyncio.Task | None = None

    def serving(self, server: uvicorn.Server, listener: socket.socket) -> list[socket.socket]:
        """The sockets to pass to server.serve(): a duplicate, so that closing it stops
        accepting while `listener` keeps the kernel's queue."""
        self.server, self.listener = server, listener
        return [listener.dup()]

    def opened(self) -> None:
        self.open += 1
        if self.open >= self.cap and not self.paused:
            self.paused = True
            for server in self.server.servers:
                server.close()
            log.warning(
                "%d connections open, the most this API server's open-files limit leaves "
                "room for (%d of RLIMIT_NOFILE %d): new connections wait in the listen "
                "backlog until %d remain; raise the limit (ulimit -n) or add API servers",
                self.open,
                self.cap,
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                self.resume_at,
            )

    def closed(self) -> None:
        self.open -= 1
        if self.paused and self.open <= self.resume_at and self.reopening is None:
            self.reopening = asyncio.get_running_loop().create_task(self._reopen())

    async def _reopen(self) -> None:
        server, config = self.server, self.server.config
        try:
            if server.should_exit:
                return
            # uvicorn's own protocol factory (Server.startup), on a fresh duplicate.
            protocol = functools.partial(
                config.http_protocol_class,
                config=config,
                server_state=server.server_state,
                app_state=server.lifespan.state,
            )
            reopened = await asyncio.get_running_loop().create_server(
                protocol, sock=self.listener.dup(), ssl=config.ssl, backlog=config.backlog
            )
            server.servers = [reopened]
            self.paused = False
            log.info("accepting connections again: %d open", self.open)
        finally:
            self.reopening = None
