"""What the API server knows of each engine and of each request it sent one: the
engine's state, a request's output stream, the link's settings, and the errors a
dead or sleeping engine raises."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from protocol.messages import EngineCoreOutput, EngineReady, SchedulerStats
from protocol.sockets import CurveKeys


class EngineDeadError(RuntimeError):
    """An engine this request depends on has died."""


class EngineAsleepError(EngineDeadError):
    """Every engine this request could use is asleep (or going to sleep): sleep mode."""


@dataclass
class EngineState:
    rank: int
    identity: bytes
    ready: EngineReady | None = None
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    in_flight: int = 0  # this API server's sequences on this engine (a beam search: n)
    alive: bool = True
    dead_reason: str = ""
    last_seen: float = 0.0
    steps_changed_at: float = 0.0  # when stats.num_steps last moved (hang detection)


class RequestStream:
    """Outputs of one engine request, in order, for the coroutine that serves it."""

    __slots__ = ("request_id", "engine", "items", "event", "finished", "error", "weight")

    def __init__(
        self,
        request_id: str,
        engine: EngineState,
        event: asyncio.Event | None = None,
        weight: int = 1,
    ) -> None:
        self.request_id = request_id
        self.engine = engine
        self.weight = weight  # its share of engine.in_flight: the sequences it runs
        self.items: list[EngineCoreOutput] = []
        # Sibling streams of one API call (n > 1, several prompts) share one event.
        self.event = event or asyncio.Event()
        self.finished = False
        self.error: BaseException | None = None

    def put(self, output: EngineCoreOutput) -> None:
        self.items.append(output)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


@dataclass
class ClientConfig:
    client_index: int
    num_engines: int
    input_address: str  # where our ROUTER binds (engines' DEALERs connect)
    output_address: str  # where our PULL binds (engines' PUSHes connect)
    curve: CurveKeys | None = None
    heartbeat_timeout_s: float = 30.0
