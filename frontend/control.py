"""Messages on the pipe between the supervisor and one API server (a local
multiprocessing pipe, never the network). Defined here because the frontend may not
import the launcher, which may import the frontend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EndpointsBound:
    """API server → supervisor, first: the ZMQ endpoints it bound, for the engines."""

    input_address: str  # requests to the engines (ROUTER)
    output_address: str  # the engines' outputs (PULL)


@dataclass(frozen=True)
class Serving:
    """API server → supervisor: every engine is ready and HTTP is being served."""

    pid: int


@dataclass(frozen=True)
class EngineDead:
    """Either way: engine `rank` is gone. From an API server, it noticed (the engine
    may be on another node); from the supervisor, the server is failing because of it."""

    rank: int
    reason: str
    # Which start of the rank died (EngineReady.incarnation); -1: whichever runs now.
    # A report about an earlier one is stale once the rank has re-joined.
    incarnation: int = -1
    # Hung or silent rather than gone: its process may still run (EngineState.dead_stuck).
    stuck: bool = False


ControlMessage = EndpointsBound | Serving | EngineDead
