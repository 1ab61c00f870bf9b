"""The engine's side of the control routes: sleep and wake-up with their request
modes, pause and resume, the prefix cache reset, the profiler, and the allow-listed
collective RPCs.

Each control is a utility call (protocol/controls.py names them) that the busy loop
hands here. Most answer at once; a sleep in mode `wait` answers once the engine's own
requests have finished (`after_step`). While asleep, or draining towards sleep, the
engine refuses new requests with an UNAVAILABLE output (a 503 at the API server), and
the API servers hear of every change of state at once (`EngineCoreProc.push_state`).
A paused engine takes new requests and holds them in its queue (`Scheduler.hold`); a
pause in mode `wait` answers once its running requests have finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_core.config import ProfilerConfig
from engine_core.sleep_mode import SleepMode, memory_usage
from protocol.controls import (
    ABORT_REQUESTS,
    COLLECTIVE_RPC,
    COLLECTIVE_RPC_METHODS,
    CONFLICT,
    HOLD_ALL,
    HOLD_NEW,
    IS_PAUSED,
    IS_SLEEPING,
    MAX_ABORT_IDS,
    PAUSE,
    PAUSE_MODES,
    RESET_PREFIX_CACHE,
    RESUME,
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
        self.pending_pause: tuple[bool, Reply] | None = None  # (clear_cache, reply), wait

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
        elif method == PAUSE:
            self.pause(*args, reply=reply)
        elif method == RESUME:
            reply(self.resume())
        elif method == IS_PAUSED:
            reply(self.engine.scheduler.hold is not None)
        elif method == ABORT_REQUESTS:
            reply(self.abort_requests(*args))
        else:
            raise ValueError(f"unknown control {method!r}")

    def abort_requests(self, api_ids: list[str]) -> list[str]:
        if not isinstance(api_ids, list) or len(api_ids) > MAX_ABORT_IDS:
            raise ValueError(f"request ids: a list of at most {MAX_ABORT_IDS} is expected")
        if not all(isinstance(rid, str) for rid in api_ids):
            raise ValueError("request ids must be strings")
        return self.proc.abort_api_requests(api_ids)

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
        """Busy loop, each turn: a sleep that waited goes ahead once the engine is idle,
        a pause that waited answers once nothing runs."""
        if self.pending_pause is not None and not self.engine.scheduler.running:
            clear_cache, reply = self.pending_pause
            self.pending_pause = None
            reply(self._paused("wait", 0, clear_cache))
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

    # --- pause ---------------------------------------------------------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = True, *, reply: Reply) -> None:
        """Stop scheduling: new requests queue until a resume. `clear_cache`: forget the
        cached prefix blocks once nothing runs (not in mode keep, which keeps them)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        if self.pending_pause is not None:
            reply({CONFLICT: "already pausing (mode=wait): its running requests are finishing"})
            return
        scheduler = self.engine.scheduler
        scheduler.hold = HOLD_ALL if mode == "keep" else HOLD_NEW
        self.proc.push_state()  # no API server takes the held requests for a hang
        if mode == "keep":
            reply(self._paused(mode, 0, False))
            return
        ended = 0
        if mode == "abort":
            ended = self.proc.end_all_requests(
                f"engine {self.rank} was paused (POST /pause?mode=abort): retry once it has resumed"
            )
        elif scheduler.running:
            self.pending_pause = (clear_cache, reply)
            log.info("engine %d: pausing once its running requests have finished", self.rank)
            return
        reply(self._paused(mode, ended, clear_cache))

    def _paused(self, mode: str, ended: int, clear_cache: bool) -> dict:
        cleared = clear_cache and self.engine.reset_prefix_cache()
        log.info(
            "engine %d paused (mode %s): %d request(s) held, %d ended, prefix cache %s",
            self.rank, mode, len(self.engine.requests), ended,
            "cleared" if cleared else "kept",
        )  # fmt: skip
        return {"rank": self.rank, "mode": mode, "aborted": ended, "cache_cleared": cleared}

    def resume(self) -> dict:
        """Schedule again; a pause still waiting for its requests is cancelled (it
        answers with the conflict)."""
        scheduler = self.engine.scheduler
        was_paused = scheduler.hold is not None
        scheduler.hold = None
        self.proc.push_state()
        if self.pending_pause is not None:
            _, reply = self.pending_pause
            self.pending_pause = None
            reply({CONFLICT: "cancelled by a resume before the running requests finished"})
        if was_paused:
            log.info(
                "engine %d resumed: %d request(s) to run", self.rank, len(self.engine.requests)
            )
        return {"rank": self.rank, "resumed": was_paused}

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
        if start:
            result = self.profiler.start()
        else:
            self.proc.push_state(blocked_s=self.profiler.stop_allowance_s())
            try:
                result = self.profiler.stop()
            finally:
                self.proc.push_state()
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
