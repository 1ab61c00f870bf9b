"""Hardening pieces that need no server: the limit checks, the log's escaping, the chat
template's error text, and the watchdog that must not blame an engine for its own stall."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from jinja2 import TemplateError, TemplateSyntaxError

from frontend.chat_prompt import template_error
from frontend.engine_client import EngineClient
from frontend.engine_state import ClientConfig
from frontend.errors import APIError
from frontend.limits import (
    RequestLimits,
    check_fan_out,
    check_prompt_count,
    check_request_id,
    check_stop_strings,
)
from launcher.logs import setup_logging
from protocol.messages import SchedulerStats

LIMITS = RequestLimits()


@pytest.mark.parametrize(
    ("check", "param", "words"),
    [
        (lambda: check_request_id("r" * 257, "request_id", LIMITS), "request_id", ["257", "256"]),
        (lambda: check_request_id("", "X-Request-Id", LIMITS), "X-Request-Id", ["empty"]),
        (lambda: check_prompt_count(1025, LIMITS), "prompt", ["1025", "1024"]),
        (lambda: check_fan_out(1, 1025, LIMITS), "n", ["n must be at most 1024"]),
        (lambda: check_fan_out(33, 32, LIMITS), "n", ["1056 sequences", "1024"]),
        (lambda: check_stop_strings(["s"] * 65, LIMITS), "stop", ["65", "64"]),
        (lambda: check_stop_strings(["s" * 1025], LIMITS), "stop", ["1025", "1024"]),
    ],
)
def test_each_limit_is_a_400_naming_the_field_the_limit_and_the_flag(check, param, words):
    with pytest.raises(APIError) as e:
        check()
    assert e.value.status == 400 and e.value.param == param
    assert all(w in e.value.message for w in words), e.value.message
    assert "(--max-" in e.value.message or "empty" in e.value.message


def test_values_at_the_limits_pass():
    check_request_id("r" * 256, "request_id", LIMITS)
    check_request_id("é\n≠", "request_id", LIMITS)  # any characters; the log escapes them
    check_prompt_count(1024, LIMITS)
    check_fan_out(32, 32, LIMITS)
    check_stop_strings(["s" * 1024] * 64, LIMITS)


def test_a_log_message_cannot_start_a_line_of_its_own(capsys):
    setup_logging("test0")
    logging.getLogger("t").warning("id %s", "x\n12:00:00 ERROR forged\r\x1b[31m\u2028")
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "x\\n12:00:00 ERROR forged\\r\\x1b[31m\\u2028" in err


def test_a_templates_own_raise_exception_message_reaches_the_client():
    error = template_error(TemplateError("Conversation roles must alternate user/assistant"))
    assert error.status == 400 and error.param == "messages"
    assert "roles must alternate" in error.message


def test_other_template_failures_answer_a_generic_message():
    for exc in (
        TemplateSyntaxError("unexpected '}' at /home/op/templates/x.jinja", 3),
        TypeError("'NoneType' object is not subscriptable"),
        ZeroDivisionError("division by zero"),
    ):
        error = template_error(exc)
        assert error.status == 400 and error.param == "messages"
        assert str(exc) not in error.message and type(exc).__name__ not in error.message


def _one_engine_client(tmp_path, name) -> EngineClient:
    """An API server's engine client for one engine that never starts: its watchdog
    judges whatever a test sets on the EngineState, with a 1 s heartbeat timeout."""
    return EngineClient(
        ClientConfig(
            client_index=0,
            num_engines=1,
            input_address=f"ipc://{tmp_path}/in-{name}",
            output_address=f"ipc://{tmp_path}/out-{name}",
            heartbeat_timeout_s=1.0,
        )
    )


def test_an_engine_that_computes_without_stepping_is_hung_only_after_ten_timeouts(tmp_path):
    """No step for longer than the timeout while it has work: hung at once if its CPU
    time stands still, not while it rises (a long step), and hung anyway after
    LONGEST_STEP_TIMEOUTS timeouts (a loop that never ends computes too)."""

    async def scenario(name: str, cpu_per_s: float, stalled_s: float) -> str:
        client = _one_engine_client(tmp_path, name)
        engine = client.engines[0]
        engine.stats = SchedulerStats(num_running=1, num_steps=7)
        now = time.monotonic()
        engine.steps_changed_at = now - stalled_s
        engine.heard_cpu(100.0, now - 0.5)  # the heartbeats' CPU seconds, half a second apart
        engine.heard_cpu(100.0 + 0.5 * cpu_per_s, now)
        engine.last_seen = now
        watchdog = asyncio.ensure_future(client._watchdog())
        try:
            await asyncio.sleep(0.4)
            return "alive" if engine.alive else engine.dead_reason
        finally:
            watchdog.cancel()
            client.close()

    assert asyncio.run(scenario("long-step", 1.0, 5.0)) == "alive"
    assert asyncio.run(scenario("crowded", 0.3, 5.0)) == "alive"
    idle = asyncio.run(scenario("idle", 0.01, 5.0))
    assert idle.startswith("hung: no engine step for 5.") and "while it has work" in idle
    endless = asyncio.run(scenario("endless", 1.0, 10.5))
    assert "computing all along (a step may take 10 x --engine-heartbeat-timeout 1)" in endless


def test_the_watchdog_does_not_count_its_own_loops_stall_as_engine_silence(tmp_path):
    """A synchronous call blocks the loop for longer than the heartbeat timeout: no engine
    message could be read meanwhile, so no engine is declared dead. Without the stall,
    the same silence is (the control)."""

    async def scenario(stall: bool) -> bool:
        client = _one_engine_client(tmp_path, stall)
        engine = client.engines[0]
        engine.last_seen = engine.steps_changed_at = time.monotonic()
        watchdog = asyncio.ensure_future(client._watchdog())
        try:
            await asyncio.sleep(0.3)
            engine.last_seen = time.monotonic()  # the engine's last message
            if stall:
                time.sleep(2.0)  # the loop is blocked: nothing can be read
                await asyncio.sleep(0.3)
            else:
                await asyncio.sleep(2.3)  # the loop runs, and the engine says nothing
            return engine.alive
        finally:
            watchdog.cancel()
            client.close()

    assert asyncio.run(scenario(stall=True)) is True
    assert asyncio.run(scenario(stall=False)) is False
