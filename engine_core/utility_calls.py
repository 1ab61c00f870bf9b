"""UTILITY calls from an API server: which engine methods may be called, and how a
call is answered (a value, a failure, or later for a Future)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from engine_core.lora_adapter import LoraError
from protocol.controls import CONTROL_METHODS

if TYPE_CHECKING:
    from engine_core.controls import EngineControls
    from engine_core.engine import EngineCore

Reply = Callable[..., None]  # reply(value) or reply(failure=message)

UTILITY_METHODS = (
    "reset_prefix_cache",
    "make_stats",
    "ping",
    "add_lora",
    "remove_lora",
    "list_loras",
)


def dispatch(
    method: str, args: list, engine: EngineCore, controls: EngineControls, reply: Reply
) -> None:
    """Run one call; the engine controls (sleep, profiler, …) answer through `reply`
    themselves. Raises what the method raises."""
    if method in CONTROL_METHODS:
        controls.handle(method, args, reply)
    elif method not in UTILITY_METHODS:
        reply(failure=f"unknown method {method!r}")
    elif method == "ping":
        reply("pong")
    else:
        value = getattr(engine, method)(*args)
        if isinstance(value, Future):
            # Answered when done (a LoRA load, on its own thread): the busy loop takes
            # the result in, and this callback answers then.
            value.add_done_callback(lambda done: _reply_when_done(done, reply))
        else:
            reply(value)


def _reply_when_done(done: Future, reply: Reply) -> None:
    error = done.exception()
    if error is None:
        reply(done.result())
    else:
        reply(failure=failure_message(error))


def failure_message(error: BaseException) -> str:
    """A failed call's message: a LoRA refusal as is (the API server answers it to the
    client), anything else with its type."""
    if isinstance(error, LoraError):
        return str(error)
    return f"{type(error).__name__}: {error}"
