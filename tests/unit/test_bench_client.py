"""The load generator's client: chunk timing, usage, failures, concurrency, headers."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from bench_fake_openai import CHUNK_DELAY_S, fake_openai_server

from benchmarks.client import Endpoint, _events
from benchmarks.datasets import SampleRequest
from benchmarks.load import LoadPlan, arrival_times, run_load, run_one

pytestmark = pytest.mark.timeout(60)


def _endpoint(base_url: str, chat: bool = False, **kw) -> Endpoint:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Endpoint(api_url=base_url + path, model="fake-model", chat=chat, **kw)


def _one(base_url: str, prompt: str, max_tokens: int = 5, chat: bool = False, **kw):
    req = SampleRequest(prompt=prompt, prompt_len=3, output_len=max_tokens)
    return asyncio.run(run_one(_endpoint(base_url, chat, **kw), req, timeout_s=30))


def test_completion_stream_is_timed_per_chunk_and_counts_usage_tokens():
    with fake_openai_server() as server:
        r = _one(server.base_url, "ok go", max_tokens=5)
    assert r.success, r.error
    assert r.output_tokens == 5 and r.usage_reported
    assert r.prompt_len == 7  # the server's usage wins over the dataset's count
    assert r.generated_text == " w0 w1 w2 w3 w4"
    assert len(r.itl) == 4
    assert r.ttft >= CHUNK_DELAY_S
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))


def test_request_body_asks_for_usage_and_carries_sampling_fields():
    with fake_openai_server() as server:
        _one(server.base_url, "ok x", ignore_eos=True, temperature=0.0, extra_body={"top_k": 3})
        body = server.bodies[0]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0.0
    assert body["top_k"] == 3


def test_chat_role_only_chunk_is_not_the_first_token():
    with fake_openai_server() as server:
        r = _one(server.base_url, "ok chat", max_tokens=3, chat=True)
        body = server.bodies[0]
    assert r.success, r.error
    assert body["messages"] == [{"role": "user", "content": "ok chat"}]
    assert r.generated_text == " w0 w1 w2"
    assert len(r.itl) == 2  # three content chunks; the role chunk is ignored


def test_stream_without_usage_leaves_token_count_to_the_tokenizer():
    with fake_openai_server() as server:
        r = _one(server.base_url, "nousage x", max_tokens=4)
    assert r.success
    assert r.output_tokens is None and not r.usage_reported
    assert r.generated_text == " w0 w1 w2 w3"


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ("errorevent x", "engine died"),
        ("http500 x", "HTTP 500"),
        ("empty x", "without any generated chunk"),
    ],
)
def test_failed_request_is_kept_with_its_error(prompt: str, error: str):
    with fake_openai_server() as server:
        r = _one(server.base_url, prompt)
    assert not r.success
    assert error in r.error


def test_connection_refused_is_a_failed_request_not_an_exception():
    r = _one("http://127.0.0.1:9", "ok x")
    assert not r.success and r.error


def test_headers_carry_api_key_and_custom_values():
    with fake_openai_server() as server:
        _one(server.base_url, "ok x", headers={"Authorization": "Bearer k1", "X-Test": "v"})
        sent = server.headers[0]
    assert sent["Authorization"] == "Bearer k1"
    assert sent["X-Test"] == "v"


def test_max_concurrency_caps_requests_in_flight_and_every_request_runs():
    reqs = [SampleRequest("ok x", 3, 8) for _ in range(24)]
    with fake_openai_server() as server:
        plan = LoadPlan(max_concurrency=4, progress=False)
        load = asyncio.run(run_load(_endpoint(server.base_url), reqs, plan))
        peak = server.peak_in_flight
    assert all(r.success for r in load.results)
    assert peak == 4
    assert load.duration > 0


def test_unlimited_concurrency_is_real_beyond_aiohttp_default_pool():
    reqs = [SampleRequest("ok x", 3, 20) for _ in range(150)]
    with fake_openai_server() as server:
        load = asyncio.run(run_load(_endpoint(server.base_url), reqs, LoadPlan(progress=False)))
        peak = server.peak_in_flight
    assert all(r.success for r in load.results)
    assert peak > 100  # aiohttp's default connector would cap it at 100


def test_sse_events_split_across_reads_and_comments_are_skipped():
    buf = bytearray(b': keep-alive\n\ndata: {"a": 1}\n\ndata: {"b"')
    assert _events(buf) == [b'{"a": 1}']
    buf += b": 2}\n\n"
    assert _events(buf) == [b'{"b": 2}']
    assert buf == b""


def test_infinite_rate_dispatches_everything_at_once():
    assert arrival_times(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_average_the_requested_rate_whatever_the_burstiness(burstiness: float):
    times = arrival_times(20001, 50.0, burstiness, random.Random(1))
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert times[0] == 0.0
    assert mean == pytest.approx(1 / 50.0, rel=0.05)
    # gamma(shape k, mean m) has variance m²/k: burstiness sets how uneven the gaps are
    assert var == pytest.approx(mean**2 / burstiness, rel=0.15)
