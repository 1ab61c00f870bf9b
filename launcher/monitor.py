"""Watching a running server: every child's death and every API server's message."""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import wait as wait_connections

from frontend.control import EngineDead
from launcher.api_servers import APIServers
from launcher.children import Child, describe

log = logging.getLogger("zserve.supervisor")

# After an engine dies: time for the API servers to send error events and answer
# /health 503 before the server exits.
ENGINE_DEATH_GRACE_S = 2.0


def monitor(api_servers: APIServers | None, engines: list[Child]) -> int:
    """Watch every child until a failure (→ 1); a signal ends the wait from outside.

    An API server that dies is restarted on the same port with the same index
    and endpoints. An engine that dies (seen here, or reported by an API server
    for engines on other nodes) fails the server: the API servers first end its
    requests with errors and answer /health 503, then everything stops, so an
    orchestrator restarts the whole server.
    """
    failure: EngineDead | None = None
    while True:
        api = api_servers.children if api_servers is not None else []  # None: headless
        waitables = {c.process.sentinel: c for c in api + engines}
        waitables.update({c.pipe: c for c in api if c.pipe is not None})
        for ready in wait_connections(list(waitables), timeout=1.0):
            child = waitables[ready]
            if ready is child.pipe:
                message = _read(child)
                if isinstance(message, EngineDead) and failure is None:
                    failure = EngineDead(message.rank, f"engine {message.rank}: {message.reason}")
            elif child in engines:
                child.process.join(1)  # reap it, so its exit code is known
                return _engine_failed(
                    api_servers,
                    child.rank,
                    f"{child.name} (pid {child.process.pid}) died with exit code "
                    f"{describe(child.process.exitcode)}",
                )
            else:
                api_servers.restart(child)
        if failure is not None:
            return _engine_failed(api_servers, failure.rank, failure.reason)


def _read(child: Child) -> object:
    try:
        return child.pipe.recv()
    except (EOFError, OSError):
        child.pipe.close()
        child.pipe = None  # its death shows on the sentinel
        return None


def _engine_failed(api_servers: APIServers | None, rank: int, reason: str) -> int:
    log.error("%s; failing the server", reason)
    if api_servers is not None and rank >= 0:
        api_servers.tell_engine_dead(rank, reason)
    time.sleep(ENGINE_DEATH_GRACE_S)
    return 1
