"""Fair balancing over API servers and engines, one /metrics for the whole server, and
API-server restarts (issue 5, items 1, 2, 5, 7)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import time

import httpx
import pytest
from zserve_proc import ZServe, server_info

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"


async def _burst(base_url: str, n: int, max_tokens: int = 4, headers=None) -> list[httpx.Response]:
    async with _fresh_client(base_url) as client:
        return await asyncio.gather(
            *[
                client.post(
                    "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": f"p{i}",
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                    },
                    headers=headers,
                )
                for i in range(n)
            ]
        )


@contextlib.asynccontextmanager
async def _streams(client: httpx.AsyncClient, n: int, headers=None, keep=None):
    """n long streams open at once, closed (so aborted) on exit.

    They stay open until every one has started (its headers say where it went), so a
    split shows placement alone. With short requests it also shows the engines' speed:
    requests finish mid-burst, and the engine that finished more is less loaded and
    rightly gets more (on CI, an engine starved by its neighbours got 75 of 200).
    Streams that `keep` refuses are closed at once and replaced.
    """

    async def start(i: int) -> httpx.Response:
        request = client.build_request(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": f"p{i}",
                "max_tokens": 1000,  # seconds of decoding: none ends while the burst starts
                "ignore_eos": True,
                "stream": True,
            },
            headers=headers,
        )
        response = await client.send(request, stream=True)
        if response.status_code != 200:
            await response.aread()
            raise AssertionError(response.text)
        return response

    held: list[httpx.Response] = []
    try:
        tries = 0
        while len(held) < n and tries < 20 * n:
            batch = await asyncio.gather(*[start(tries + i) for i in range(n - len(held))])
            tries += len(batch)
            for response in batch:
                if keep is None or keep(response):
                    held.append(response)
                else:
                    await response.aclose()
        assert len(held) == n, f"only {len(held)} of {n} streams kept in {tries} tries"
        yield held
    finally:
        for response in held:
            await response.aclose()


def _fresh_client(base_url: str) -> httpx.AsyncClient:
    """A client whose every request opens its own connection, which SO_REUSEPORT
    spreads over the API servers."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120)


def _held_burst(base_url: str, n: int) -> list[httpx.Response]:
    async def run():
        async with _fresh_client(base_url) as client, _streams(client, n) as held:
            return held

    return asyncio.run(run())


def _split(responses, header: str) -> collections.Counter:
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses][:3]
    return collections.Counter(r.headers[header] for r in responses)


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def two_by_two(tiny_model):
    with ZServe(
        str(tiny_model("llama")),
        "--served-model-name",
        MODEL,
        "--api-server-count",
        "2",
        "--data-parallel-size",
        "2",
        "--kv-cache-memory-bytes",
        "64MiB",
        "--metrics-prefix",
        "vllm",
        "--disable-log-requests",
        "--enable-dev-routes",  # /server_info
    ) as s:
        yield s


def test_a_burst_before_any_stats_splits_evenly_over_engines(two_by_two):
    # The very first requests this server sees: no engine has reported load yet. Each
    # API server's own count is exact at once, but on two cores the 200 streams take
    # longer to start than the engines take to report, so the other server's requests
    # are seen late (the engines are cold, and their input and output threads wait for
    # the GIL behind their busy loops); the engine whose reports lag more gets more.
    # On 16 fresh servers 14 splits were within 2 of even, two were 110/90 and 112/88,
    # a CI-like run saw 85/115 and a local run 79/121 (the warm bursts below: 80-120).
    responses = _held_burst(two_by_two.base_url, 200)
    engines = _split(responses, "x-engine-rank")
    assert set(engines) == {"0", "1"}
    assert 70 <= engines["0"] <= 130, engines
    assert set(_split(responses, "x-api-server")) == {"0", "1"}


def test_200_concurrent_requests_from_two_api_servers_split_evenly_once_stats_flow(two_by_two):
    # Once engines report load, each API server counts its own requests itself and
    # takes only the other server's from the engines' stats. Three bursts of held
    # streams: each within 40/60 and together within 45/55 (in 24 bursts here, with a
    # busy loop hogging one core, all were within 92-108).
    totals = collections.Counter()
    for _ in range(3):
        responses = _held_burst(two_by_two.base_url, 200)
        engines = _split(responses, "x-engine-rank")
        assert 80 <= engines["0"] <= 120, engines
        api = _split(responses, "x-api-server")
        assert api["0"] > 0 and api["1"] > 0
        totals += engines
    assert 270 <= totals["0"] <= 330, totals


def test_an_api_server_steers_around_the_load_another_one_put_on_an_engine(two_by_two):
    # 60 streams pinned to engine 1, all through API server 0, then 40 unpinned ones
    # over both servers. Server 1 knows of server 0's 60 only from engine 1's stats,
    # and must still send its share to engine 0. (A server that went by its own
    # requests alone split its 20 evenly: 30/10 here, twice.)
    async def run():
        async with _fresh_client(two_by_two.base_url) as client:
            async with _streams(
                client,
                60,
                headers={"X-data-parallel-rank": "1"},
                keep=lambda r: r.headers["x-api-server"] == "0",
            ):
                await _until_every_view_shows(client, requests_on_1=60)
                async with _streams(client, 40) as burst:
                    return burst

    burst = asyncio.run(run())
    assert _split(burst, "x-engine-rank") == {"0": 40}
    assert set(_split(burst, "x-api-server")) == {"0", "1"}


async def _until_every_view_shows(client: httpx.AsyncClient, requests_on_1: int) -> None:
    """Until both API servers' view of engine 1 (its last stats) holds this many
    requests: the pinned ones, and none of the attempts that `keep` refused."""
    seen: set[int] = set()
    deadline = time.monotonic() + 30
    while seen != {0, 1}:
        assert time.monotonic() < deadline, f"only API servers {seen} saw it"
        info = (await client.get("/server_info")).json()
        if sum(info["engines"][1]["stats"]["num_requests_by_client"]) == requests_on_1:
            seen.add(info["api_server_index"])
        else:
            await asyncio.sleep(0.05)


def test_every_api_server_sees_both_engines_idle_right_after_a_burst(two_by_two):
    # An engine rate-limits its stats to a server without outputs in a step (100 ms)
    # and, once idle, used to say nothing more until its 1 s heartbeat: a server could
    # keep steering the next burst by an engine's load from before it went idle.
    responses = asyncio.run(_burst(two_by_two.base_url, 200, max_tokens=16))
    assert set(_split(responses, "x-api-server")) == {"0", "1"}
    time.sleep(0.3)  # > one stats interval, < the heartbeat
    # Fresh connections, which SO_REUSEPORT spreads over both API servers; each
    # renders the engine gauges from its own view of the engines.
    views = []
    for _ in range(12):
        with httpx.Client(base_url=two_by_two.base_url, timeout=10) as client:
            text = client.get("/metrics").text
        views.append(
            {
                engine: (
                    _metric(text, "vllm:num_requests_running", engine=engine),
                    _metric(text, "vllm:num_requests_waiting", engine=engine),
                )
                for engine in ("0", "1")
            }
        )
    assert all(view == {"0": (0, 0), "1": (0, 0)} for view in views), views


def test_x_data_parallel_rank_pins_an_engine_and_out_of_range_is_400(two_by_two):
    responses = asyncio.run(_burst(two_by_two.base_url, 20, headers={"X-data-parallel-rank": "1"}))
    assert _split(responses, "x-engine-rank") == {"1": 20}
    bad = httpx.post(
        two_by_two.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={"X-data-parallel-rank": "2"},
    )
    assert bad.status_code == 400
    assert "X-data-parallel-rank" in bad.json()["error"]["message"]
    assert "0..1" in bad.json()["error"]["message"]


def test_metrics_on_any_api_server_show_the_whole_server(two_by_two):
    base = two_by_two.base_url
    before = httpx.get(base + "/metrics").text
    n_before = _metric(before, "vllm:request_success_total")
    responses = asyncio.run(_burst(base, 30, max_tokens=3))
    api = _split(responses, "x-api-server")
    assert set(api) == {"0", "1"}  # both API servers served some of them
    seen_servers = set()
    for _ in range(20):  # new connections land on both API servers
        r = httpx.get(base + "/metrics", headers={"Connection": "close"})
        text = r.text
        assert _metric(text, "vllm:request_success_total") == n_before + 30
        assert _metric(text, "vllm:request_success_total", finished_reason="length") >= 30
        assert _metric(text, "vllm:generation_tokens_total") >= 90
        assert _metric(text, "vllm:e2e_request_latency_seconds_count") == n_before + 30
        for engine in ("0", "1"):
            assert f'vllm:num_requests_running{{engine="{engine}",model_name="{MODEL}"}}' in text
            assert f'vllm:kv_cache_usage_perc{{engine="{engine}"' in text
        assert "vllm:prefix_cache_queries_total" in text
        seen_servers.add(server_info(base)["api_server_index"])
    assert not re.search(r"^zserve:", before, re.M)  # --metrics-prefix vllm replaces ours


def test_a_dead_api_server_is_restarted_and_engines_keep_serving(two_by_two):
    base = two_by_two.base_url
    infos = {}
    while len(infos) < 2:
        info = server_info(base, headers={"Connection": "close"})
        infos[info["api_server_index"]] = info
    victim = infos[1]["pid"]
    aborted_before = sum(e["stats"]["num_aborted"] for e in infos[0]["engines"])
    # a long request in flight on the victim, to be aborted in its engine
    long_stream = httpx.Client(base_url=base, timeout=60)
    in_flight = None
    for _ in range(40):
        req = long_stream.build_request(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "z",
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
            },
            headers={"Connection": "close"},
        )
        resp = long_stream.send(req, stream=True)
        if resp.headers["x-api-server"] == "1":
            in_flight = resp
            break
        resp.close()
    assert in_flight is not None
    # Its first token is out, so an engine holds it: the response's headers come before
    # the request reaches an engine, and a kill in between could lose it on the way.
    assert next(line for line in in_flight.iter_lines() if line).startswith("data: ")
    os.kill(victim, signal.SIGKILL)
    # the other API server keeps serving on the same port meanwhile
    deadline = time.monotonic() + 60
    restarted = None
    while time.monotonic() < deadline:
        try:
            r = httpx.post(
                base + "/v1/completions",
                headers={"Connection": "close"},
                json={"model": MODEL, "prompt": "a", "max_tokens": 2},
                timeout=10,
            )
            assert r.status_code == 200
            info = server_info(base, headers={"Connection": "close"})
            if info["api_server_index"] == 1 and info["pid"] != victim:
                restarted = info
                break
        except httpx.TransportError:
            pass  # a connection that landed on the dead listener's queue
        time.sleep(0.1)
    in_flight.close()
    long_stream.close()
    assert restarted is not None, two_by_two.log()[-3000:]
    # the restarted server serves, through both engines
    responses = asyncio.run(_burst(base, 40))
    assert set(_split(responses, "x-engine-rank")) == {"0", "1"}
    metrics = httpx.get(base + "/metrics").text
    assert _metric(metrics, "vllm:api_server_restarts_total") == 1
    engines = server_info(base)["engines"]
    assert sum(e["stats"]["num_aborted"] for e in engines) > aborted_before
    assert "restarting it" in two_by_two.log()
