"""--engine-restart-policy on-failure: an engine that dies is stopped, started again
as its rank's next incarnation, and re-joins through the handshake while the other
engines and every API server go on serving.

The API servers have already failed the dead engine's requests and answer /health
503 until it is back; the new incarnation announces itself on each API server's
ROUTER, which takes it as the rank re-joining (frontend/engine_client.py: _rejoin).
Reports about an earlier incarnation (an API server's late EngineDead, say) are
stale and ignored. A rank that dies too often, or does not come back in time,
fails the server as the default policy does at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from launcher.engine_handshake import EngineHandshake
from launcher.engine_set import EngineExit, EngineSet
from protocol.handshake import EnginePlan

log = logging.getLogger("zserve.supervisor")

# More restarts of one rank than this within RESTART_WINDOW_S: a crash loop; give up.
MAX_RESTARTS_PER_RANK = 3
RESTART_WINDOW_S = 600.0


class EngineRestarts:
    def __init__(
        self,
        engines: EngineSet,
        handshake: EngineHandshake,
        plan: Callable[[], EnginePlan],
        start: Callable[[int, int], None],
        ready_timeout_s: float,
    ) -> None:
        self.engines = engines
        self.handshake = handshake
        self.plan = plan  # the API servers' endpoints, as they are now
        self.start = start  # (rank, incarnation) → that engine started
        self.ready_timeout_s = ready_timeout_s
        self.incarnations: dict[int, int] = {}  # rank → its newest; 0 if never restarted
        self.pending: dict[int, float] = {}  # rank → deadline of its READY
        self.history: dict[int, list[float]] = {}

    def on_exit(self, death: EngineExit) -> str | None:
        """Start the rank again; or why the server must fail instead. A report about
        an earlier incarnation, or about one already being restarted, changes nothing."""
        current = self.incarnations.get(death.rank, 0)
        if death.incarnation < current or (death.rank in self.pending and death.incarnation < 0):
            return None
        now = time.monotonic()
        recent = [t for t in self.history.get(death.rank, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_RESTARTS_PER_RANK:
            return (
                f"engine {death.rank}: {death.reason}; it was restarted {len(recent)} times "
                f"in {RESTART_WINDOW_S:.0f} s, giving up"
            )
        self.history[death.rank] = [*recent, now]
        incarnation = max(current, death.incarnation) + 1
        log.error(
            "engine %d: %s; restarting it (incarnation %d)", death.rank, death.reason, incarnation
        )
        self.engines.stop(death.rank, dump_stacks=death.stuck)  # a hung one still runs
        self.incarnations[death.rank] = incarnation
        self.pending[death.rank] = now + self.ready_timeout_s
        self.start(death.rank, incarnation)
        return None

    def poll(self) -> str | None:
        """Answer the restarted engines' handshakes; why the server must fail, if one
        did not come back in time."""
        if not self.pending:
            return None
        expected = {rank: self.incarnations[rank] for rank in self.pending}
        for rank in self.handshake.rejoin(self.plan(), expected):
            del self.pending[rank]
            log.info("engine %d is back (incarnation %d)", rank, self.incarnations[rank])
        now = time.monotonic()
        for rank, deadline in self.pending.items():
            if now > deadline:
                return (
                    f"engine {rank} (incarnation {self.incarnations[rank]}) was not ready "
                    f"within {self.ready_timeout_s:.0f} s of its restart (--engine-ready-timeout)"
                )
        return None
