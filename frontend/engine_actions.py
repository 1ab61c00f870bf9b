"""Control actions on every engine of the deployment (local and headless), for the
development and profiler routes (serving_dev.py) and the gRPC door alike.

Each action checks its arguments (a 400 naming the parameter), sends one utility call
to every engine at once, and answers once every engine has: one result per engine, in
rank order. Failures are APIErrors whose status says what went wrong: 409 when every
engine refused in its current state (sleep while asleep, stop a profiler never
started), 503 when an engine is dead or dies before it answers, 504 past a timeout,
500 when an engine failed.
"""

from __future__ import annotations

import asyncio
import logging

from frontend.engine_client import EngineClient
from frontend.engine_state import EngineDeadError, EngineState
from frontend.errors import APIError
from protocol.controls import (
    ABORT_REQUESTS,
    COLLECTIVE_RPC,
    COLLECTIVE_RPC_METHODS,
    CONFLICT,
    IS_PAUSED,
    IS_SLEEPING,
    PAUSE,
    PAUSE_MODES,
    RESET_PREFIX_CACHE,
    RESUME,
    SLEEP,
    SLEEP_LEVELS,
    SLEEP_MODES,
    START_PROFILE,
    STOP_PROFILE,
    WAKE_TAGS,
    WAKE_UP,
)

log = logging.getLogger("zserve.api")

MAX_RPC_TIMEOUT_S = 3600.0
_POLL_S = 0.25  # how often a waiting action looks for engines that died meanwhile


async def reset_prefix_cache(
    client: EngineClient, reset_running_requests: bool = False
) -> list[dict]:
    """Forget every engine's cached prefix blocks. Refused (409) where an engine has
    requests running on them, unless `reset_running_requests` (they are preempted and
    recomputed)."""
    results = await broadcast(client, RESET_PREFIX_CACHE, reset_running_requests)
    refused = _conflicts(client, results)
    if refused:
        raise APIError("; ".join(refused), 409)
    return results


async def sleep(client: EngineClient, level: int = 1, mode: str = "abort") -> list[dict]:
    """Put every engine to sleep (protocol/controls.py: SLEEP_LEVELS, SLEEP_MODES); 409
    when every engine was asleep already."""
    if level not in SLEEP_LEVELS:
        raise APIError(f"level must be one of {list(SLEEP_LEVELS)}, got {level!r}", param="level")
    _check_mode(mode, SLEEP_MODES)
    log.info("putting every engine to sleep: level %d, mode %s", level, mode)
    return _unless_all_refused(client, await broadcast(client, SLEEP, level, mode))


async def wake_up(client: EngineClient, tags: list[str] | None = None) -> list[dict]:
    """Wake every engine up (only what `tags` names: WAKE_TAGS; all when none); 409 when
    every engine was awake already."""
    tags = list(dict.fromkeys(tags)) if tags else None
    unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
    if unknown:
        raise APIError(
            f"unknown tags {unknown}: a wake-up restores {list(WAKE_TAGS)}", param="tags"
        )
    log.info("waking every engine up: %s", ", ".join(tags) if tags else "everything")
    return _unless_all_refused(client, await broadcast(client, WAKE_UP, tags))


async def is_sleeping(client: EngineClient) -> bool:
    """Whether any engine sleeps, as the engines themselves say."""
    return any(await broadcast(client, IS_SLEEPING))


async def pause(client: EngineClient, mode: str = "abort", clear_cache: bool = True) -> list[dict]:
    """Pause every engine (protocol/controls.py: PAUSE_MODES): new requests queue until
    a resume. Mode wait answers once every engine's running requests have finished; 409
    when every engine was already pausing that way."""
    _check_mode(mode, PAUSE_MODES)
    log.info("pausing every engine: mode %s, clear_cache %s", mode, clear_cache)
    return _unless_all_refused(client, await broadcast(client, PAUSE, mode, clear_cache))


async def resume(client: EngineClient) -> list[dict]:
    log.info("resuming every engine")
    return _unless_all_refused(client, await broadcast(client, RESUME))


async def is_paused(client: EngineClient) -> bool:
    """Whether any engine is paused, as the engines themselves say."""
    return any(await broadcast(client, IS_PAUSED))


async def start_profile(client: EngineClient) -> list[dict]:
    log.info("starting the profiler in every engine")
    return _unless_all_refused(client, await broadcast(client, START_PROFILE))


async def stop_profile(client: EngineClient) -> list[dict]:
    """Stop every engine's profiler; each result names the trace its engine wrote."""
    log.info("stopping the profiler in every engine")
    return _unless_all_refused(client, await broadcast(client, STOP_PROFILE))


async def abort_requests(client: EngineClient, api_ids: list[str]) -> list[str]:
    """End these API requests wherever they run: every engine ends the engine requests
    of them it has, whichever API server sent them (each owner streams an abort). The
    ids some engine had, sorted."""
    results = await broadcast(client, ABORT_REQUESTS, api_ids)
    return sorted({rid for found in results for rid in found})


async def collective_rpc(
    client: EngineClient, method: str, timeout_s: float | None = None
) -> list[object]:
    """One allow-listed method (COLLECTIVE_RPC_METHODS) on every engine."""
    if method not in COLLECTIVE_RPC_METHODS:
        raise APIError(
            f"method {method[:64]!r} is not allowed; allowed: {', '.join(COLLECTIVE_RPC_METHODS)}",
            param="method",
        )
    if timeout_s is not None and not 0 < timeout_s <= MAX_RPC_TIMEOUT_S:
        raise APIError(f"timeout must be in (0, {MAX_RPC_TIMEOUT_S:g}] seconds", param="timeout")
    return await broadcast(client, COLLECTIVE_RPC, method, timeout_s=timeout_s)


async def broadcast(
    client: EngineClient, method: str, *args: object, timeout_s: float | None = None
) -> list[object]:
    """`method(*args)` on every engine at once; their results in rank order once all
    have answered. Never hangs on a dead engine: one found dead before or while it is
    waited for ends the action with a 503."""
    dead = [e.rank for e in client.engines if not e.alive]
    if dead:
        raise APIError(f"engines {dead} are dead; no action is possible", 503)
    calls = {
        asyncio.ensure_future(client.call_utility(engine, method, *args)): engine
        for engine in client.engines
    }
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    pending = set(calls)
    try:
        while pending:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - loop.time())
            if wait <= 0:
                late = sorted(calls[t].rank for t in pending)
                raise APIError(f"engines {late} did not answer within {timeout_s:g} s", 504)
            _, pending = await asyncio.wait(pending, timeout=wait)
            gone = sorted(calls[t].rank for t in pending if not calls[t].alive)
            if gone:
                raise APIError(f"engines {gone} died before they answered", 503)
    finally:
        for task in pending:
            task.cancel()
    return [_result(task, calls[task]) for task in calls]


def _check_mode(mode: str, modes: tuple[str, ...]) -> None:
    if mode not in modes:
        raise APIError(f"mode must be one of {list(modes)}, got {mode[:32]!r}", param="mode")


def _result(task: asyncio.Future, engine: EngineState) -> object:
    try:
        return task.result()
    except EngineDeadError as e:
        raise APIError(f"engine {engine.rank} is not reachable: {e}", 503) from None
    except RuntimeError as e:  # the engine's failure message
        raise APIError(f"engine {engine.rank} failed: {e}", 500) from None


def _conflicts(client: EngineClient, results: list[object]) -> list[str]:
    return [
        f"engine {engine.rank}: {result[CONFLICT]}"
        for engine, result in zip(client.engines, results)
        if isinstance(result, dict) and CONFLICT in result
    ]


def _unless_all_refused(client: EngineClient, results: list[object]) -> list[dict]:
    """The results, unless every engine refused in its state (then a 409 saying why);
    an engine that refused while others acted shows its reason in its result."""
    refused = _conflicts(client, results)
    if refused and len(refused) == len(results):
        raise APIError("; ".join(refused), 409)
    for engine, result in zip(client.engines, results):
        if isinstance(result, dict):
            result.setdefault("rank", engine.rank)
    return results
