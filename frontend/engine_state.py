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
    dead_stuck: bool = False  # declared dead while its process may still run (hung, silent)
    last_seen: float = 0.0
    # When stats.num_steps or num_waits last moved (hang detection).
    steps_changed_at: float = 0.0
    # Until when the engine said it blocks on purpose (stats.blocked_s): no death by
    # silence or lack of steps before then.
    blocked_until: float = 0.0
    # Its process's CPU seconds in the last heartbeat that had them (stats.cpu_s), when
    # that came, and when they last rose by COMPUTING_SHARE of a core or more: the
    # engine computes (a step longer than the timeout) rather than hangs.
    cpu_s: float = 0.0
    cpu_seen_at: float = 0.0
    computing_at: float = 0.0

    def heard_cpu(self, cpu_s: float, now: float) -> None:
        if self.cpu_s and cpu_s - self.cpu_s >= COMPUTING_SHARE * (now - self.cpu_seen_at):
            self.computing_at = now
        self.cpu_s, self.cpu_seen_at = cpu_s, now


# A hung engine's threads sleep (its heartbeat costs ~0.1 ms a second); one in a long
# step keeps at least a core busy, or a quarter of one on a crowded box.
COMPUTING_SHARE = 0.25
# A step may compute this many --engine-heartbeat-timeouts before it counts as hung (a
# loop that never ends computes too).
LONGEST_STEP_TIMEOUTS = 10


class Wakeup:
    """An asyncio.Event for one waiter (the coroutine that streams a generation), set
    once per engine output: it keeps its loop, where asyncio.Event.wait looks the
    running loop up on every wait (and Python 3.11 checks the pid for it, a system
    call per streamed token)."""

    __slots__ = ("_loop", "_waiter", "_set")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None
        self._set = False

    def set(self) -> None:
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        """Return once set; one coroutine waits at a time (a cancelled wait leaves
        no waiter behind)."""
        if self._set:
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None


class RequestStream:
    """Outputs of one engine request, in order, for the coroutine that serves it."""

    __slots__ = ("request_id", "engine", "items", "event", "finished", "error", "weight")

    def __init__(
        self,
        request_id: str,
        engine: EngineState,
        event: Wakeup | None = None,
        weight: int = 1,
    ) -> None:
        self.request_id = request_id
        self.engine = engine
        self.weight = weight  # its share of engine.in_flight: the sequences it runs
        self.items: list[EngineCoreOutput] = []
        # Sibling streams of one API call (n > 1, several prompts) share one event.
        self.event = event or Wakeup()
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
