"""Watching a running server: every child's death and every API server's message."""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import wait as wait_connections

from frontend.control import EngineDead
from launcher.api_servers import APIServers
from launcher.engine_restarts import EngineRestarts
from launcher.engine_set import EngineExit, EngineSet

log = logging.getLogger("zserve.supervisor")

# After an engine dies: time for the API servers to send error events and answer
# /health 503 before the server exits.
ENGINE_DEATH_GRACE_S = 2.0
# While restarted engines re-join: how often their handshake messages are read.
REJOIN_POLL_S = 0.1


def monitor(
    api_servers: APIServers | None, engines: EngineSet, restarts: EngineRestarts | None = None
) -> int:
    """Watch every child until a failure (→ 1); a signal ends the wait from outside.

    An API server that dies is restarted on the same port with the same index
    and endpoints. An engine that dies (seen here, or reported by an API server
    for engines on other nodes) fails the server: the API servers first end its
    requests with errors and answer /health 503, then everything stops, so an
    orchestrator restarts the whole server. With `restarts` (--engine-restart-policy
    on-failure) the engine is started again instead, and the server goes on.
    """
    while True:
        api = api_servers.children if api_servers is not None else []  # None: headless
        waitables = {c.process.sentinel: c for c in api}
        waitables.update({c.pipe: c for c in api if c.pipe is not None})
        engine_waitables = engines.waitables()
        timeout = REJOIN_POLL_S if restarts is not None and restarts.pending else 1.0
        deaths: list[EngineExit] = []
        for ready in wait_connections([*waitables, *engine_waitables], timeout=timeout):
            if ready in engine_waitables:
                deaths += engines.exits(ready)
                continue
            child = waitables[ready]
            if ready is child.pipe:
                message = _read(child)
                if isinstance(message, EngineDead):
                    reason = f"engine {message.rank}: {message.reason}"
                    deaths.append(
                        EngineExit(message.rank, message.incarnation, reason, message.stuck)
                    )
            else:
                api_servers.restart(child)
        for death in deaths:
            failure = death.reason if restarts is None else _restart(api_servers, restarts, death)
            if failure is not None:
                return _engine_failed(api_servers, death.rank, failure, engines, death.stuck)
        failure = restarts.poll() if restarts is not None else None
        if failure is not None:
            return _engine_failed(api_servers, -1, failure)


def _restart(api_servers: APIServers | None, restarts: EngineRestarts, death: EngineExit):
    """The API servers hear of the death first (its requests fail, /health 503), then
    the rank starts again; why the server must fail instead, if it must."""
    if api_servers is not None and death.incarnation >= restarts.incarnations.get(death.rank, 0):
        api_servers.tell_engine_dead(death.rank, death.reason, death.incarnation)
    return restarts.on_exit(death)


def _read(child) -> object:
    try:
        return child.pipe.recv()
    except (EOFError, OSError):
        child.pipe.close()
        child.pipe = None  # its death shows on the sentinel
        return None


def _engine_failed(
    api_servers: APIServers | None,
    rank: int,
    reason: str,
    engines: EngineSet | None = None,
    stuck: bool = False,
) -> int:
    log.error("%s; failing the server", reason)
    if stuck and engines is not None:  # no shutdown grace for an engine that hangs
        engines.stop(rank, dump_stacks=True)
    if api_servers is not None and rank >= 0:
        api_servers.tell_engine_dead(rank, reason)
    time.sleep(ENGINE_DEATH_GRACE_S)
    return 1
