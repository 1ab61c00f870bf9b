"""The engine's side of the control routes: sleep and wake-up with their request
modes, the prefix cache reset, the profiler, and the allow-listed collective RPCs.

Each control is a utility call (protocol/controls.py names them) that the busy loop
hands here. Most answer at once; a sleep in mode `wait` answers once the engine's own
requests have finished (`after_step`). While asleep, or draining towards sleep, the
engine refuses new requests with an UNAVAILABLE output (a 503 at the API server), and
the API servers hear of every change of state at once (`EngineCoreProc.push_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_core.config import ProfilerConfig
from engine_core.sleep_mode import SleepMode, memory_usage
from protocol.controls import (
    COLLECTIVE_RPC,
    COLLECTIVE_RPC_METHODS,
    CONFLICT,
    IS_SLEEPING,
    RESET_PREFIX_CACHE,
    SLEEP,
    SLEEP_LEVELS,
    SLEEP_MODES,
    START_PROFILE,
    STOP_PROFILE,
    WAKE_UP,
)
from protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, error_output

if TYPE_CHECKING:
    from engine_core.engine import EngineCore
    from engine_core.process import EngineCoreProc
    from engine_core.profiler import EngineProfiler

log = logging.getLogger("zserve.engine")

Reply = Callable[..., None]  # (value) or (None, failure message)


class EngineControls:
    def __init__(
        self, proc: EngineCoreProc, engine: EngineCore, profiler: ProfilerConfig | None
    ) -> None:
        self.proc = proc
        self.rank = proc.rank
        self.engine = engine
        self.sleep_mode = SleepMode(engine)
        self.profiler: EngineProfiler | None = None
        if profiler is not None:
            from engine_core.profiler import EngineProfiler

            self.profiler = EngineProfiler(profiler, self.rank, engine.runner.device)
        self.pending_sleep: tuple[int, Reply] | None = None  # (level, reply) in mode wait

    # --- state ------------------------------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self.sleep_mode.asleep

    @property
    def paused(self) -> bool:
        """New requests are refused: asleep, or draining towards sleep."""
        return self.asleep or self.pending_sleep is not None

    @property
    def profiling(self) -> bool:
        return self.profiler is not None and self.profiler.running is not None

    def refusal(self, request: EngineCoreRequest) -> list[EngineCoreOutput]:
        """The answer to an ADD while paused (none while the engine takes requests)."""
        if not self.paused:
            return []
        state = f"asleep (level {self.sleep_mode.level})" if self.asleep else "going to sleep"
        return [
            error_output(
                request.request_id,
                f"engine {self.rank} is {state}: retry once it is awake (POST /wake_up)",
                FinishReason.UNAVAILABLE,
            )
        ]

    # --- dispatch -----------------------------------------------------------------------

    def handle(self, method: str, args: list, reply: Reply) -> None:
        """Run one control; `reply` gets its JSON-able result (now, or later for a
        sleep that waits). Exceptions propagate: the caller answers them as failures."""
        if method == SLEEP:
            self.sleep(*args, reply=reply)
        elif method == WAKE_UP:
            reply(self.wake_up(*args))
        elif method == IS_SLEEPING:
            reply(self.asleep)
        elif method == RESET_PREFIX_CACHE:
            reply(self.reset_prefix_cache(*args))
        elif method in (START_PROFILE, STOP_PROFILE):
            reply(self.profile(method == START_PROFILE))
        elif method == COLLECTIVE_RPC:
            reply(self.collective_rpc(*args))
        else:
            raise ValueError(f"unknown control {method!r}")

    # --- sleep --------------------------------------------------------------------------

    def sleep(self, level: int, mode: str = "abort", *, reply: Reply) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")
        if mode not in SLEEP_MODES:
            raise ValueError(f"mode must be one of {SLEEP_MODES}, got {mode!r}")
        if self.asleep:
            reply({CONFLICT: f"already asleep at level {self.sleep_mode.level}"})
            return
        if self.pending_sleep is not None:
            reply({CONFLICT: "already going to sleep (mode=wait): its requests are finishing"})
            return
        if mode == "wait" and self.engine.has_unfinished_requests():
            self.pending_sleep = (level, reply)
            self.proc.push_state()  # the API servers stop sending before the engine sleeps
            log.info("engine %d: going to sleep once its requests have finished", self.rank)
            return
        ended = 0
        if mode == "abort":
            ended = self.proc.end_all_requests(
                f"engine {self.rank} was put to sleep (POST /sleep?mode=abort): "
                "retry once it is awake"
            )
        reply(self._sleep_now(level, mode, ended))

    def after_step(self) -> None:
        """Busy loop, each turn: a sleep that waited goes ahead once the engine is idle."""
        if self.pending_sleep is not None and not self.engine.has_unfinished_requests():
            level, reply = self.pending_sleep
            self.pending_sleep = None
            try:
                result = self._sleep_now(level, "wait", 0)
            except Exception as e:  # answered as the sleep's failure; the engine lives on
                log.exception("engine %d: the sleep that waited failed", self.rank)
                self.proc.push_state()
                reply(None, f"{type(e).__name__}: {e}")
                return
            reply(result)

    def _sleep_now(self, level: int, mode: str, ended: int) -> dict:
        result = self.sleep_mode.sleep(level)
        result.update(rank=self.rank, mode=mode, aborted=ended)
        self.proc.push_state()
        before, after = result["memory_before"], result["memory_after"]
        log.info(
            "engine %d asleep at level %d (mode %s): RSS %.1f -> %.1f MiB, KV cache %.1f MiB "
            "released, %d request(s) kept, %d ended",
            self.rank, level, mode, before["rss_bytes"] / 2**20, after["rss_bytes"] / 2**20,
            result["kv_cache_bytes"] / 2**20, len(self.engine.requests), ended,
        )  # fmt: skip
        return result

    def wake_up(self, tags: list[str] | None = None) -> dict:
        if self.pending_sleep is not None and not self.asleep:
            # A wake-up cancels a sleep still waiting for requests: the caller's sleep
            # answers with the conflict, this one with what it did (nothing to restore).
            _, reply = self.pending_sleep
            self.pending_sleep = None
            reply({CONFLICT: "cancelled by a wake-up before the engine fell asleep"})
            self.proc.push_state()
            return {"rank": self.rank, "restored": [], "released": [], "is_sleeping": False}
        result = self.sleep_mode.wake_up(tags)
        result["rank"] = self.rank
        if CONFLICT not in result:
            self.proc.push_state()
            after = result["memory_after"]
            log.info(
                "engine %d: restored %s, RSS now %.1f MiB%s",
                self.rank, ", ".join(result["restored"]) or "nothing",
                after["rss_bytes"] / 2**20, "; still asleep" if self.asleep else "",
            )  # fmt: skip
        return result

    # --- the others ---------------------------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict:
        preempted = 0
        if reset_running_requests and not self.asleep:
            preempted = self.engine.scheduler.preempt_all()  # recomputed next step
        if self.engine.reset_prefix_cache():
            return {"rank": self.rank, "reset": True, "preempted": preempted}
        return {
            CONFLICT: f"engine {self.rank} has requests running on cached blocks; retry when "
            "it is idle, or pass reset_running_requests=true"
        }

    def profile(self, start: bool) -> dict:
        if self.profiler is None:
            return {
                CONFLICT: f"engine {self.rank} has no profiler (start it with --profiler-config)"
            }
        result = self.profiler.start() if start else self.profiler.stop()
        result["rank"] = self.rank
        return result

    def collective_rpc(self, method: str) -> object:
        if method not in COLLECTIVE_RPC_METHODS:
            raise ValueError(f"{method!r} is not a collective_rpc method")
        if method == "ping":
            return "pong"
        if method == "is_sleeping":
            return self.asleep
        if method == "sleep_state":
            return {**self.sleep_mode.state(), "paused": self.paused}
        if method == "memory_usage":
            return memory_usage(self.engine.runner)
        if method == "get_stats":
            stats = self.proc.stats  # made each turn of the busy loop
            return {f: getattr(stats, f) for f in stats.__struct_fields__}
        return self.engine.reset_prefix_cache()
