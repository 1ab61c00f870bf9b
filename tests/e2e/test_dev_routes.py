"""Issue 18 §2: the development routes, on one deployment of two engines (rank 0 beside
two API servers, rank 1 headless, joining over TCP) behind an API key. Sleep mode for
real: each engine's RSS is measured from /proc before, asleep and after; every API
server agrees on the state; a sleep/wake cycle under load loses no admitted request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path

import httpx
import pytest
from e2e_http import MODEL, SERVED_NAMES, SSE, assert_error, async_client, parse_sse
from zserve_proc import ZServe, free_port, wait_for

pytestmark = pytest.mark.timeout(180)

KEY = "sk-dev-routes"
AUTH = {"Authorization": f"Bearer {KEY}"}
UNDER_LOAD_TOKENS = 900  # each request of the sleep-under-load test (context: 1024)
KV_BYTES = 128 << 20  # per engine: large enough that its release shows in RSS
MiB = 2**20
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    model = str(tiny_model("llama"))
    rpc = free_port()
    env = {"XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("config"))}  # engine-link keys
    common = ["--kv-cache-memory-bytes", str(KV_BYTES), "--device", "cpu"]
    dp = ["-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", str(rpc)]
    head = ZServe(
        model,
        *SERVED_NAMES,
        *common,
        *dp,
        "--api-server-count", "2",
        "--tokenizer-pool-size", "0",
        "--enable-dev-routes",
        "--enable-scale-out",  # /inference/v1/abort_requests
        "--api-key", KEY,
        env=env,
        wait_ready=False,
    )  # fmt: skip
    worker = ZServe(model, "--headless", "-dpr", "1", *common, *dp, env=env, wait_ready=False)
    try:
        head.start()
        worker.start()
        head.wait_until_ready()
        yield head
        log = head.log() + worker.log()
    finally:
        head.stop()
        worker.stop()
    assert "Traceback" not in log, log[-4000:]
    assert "SECURITY: development routes are on (--enable-dev-routes)" in log


@pytest.fixture
def http(deployment):
    with httpx.Client(base_url=deployment.base_url, headers=AUTH, timeout=60) as c:
        yield c
        # Every test leaves the engines awake (a 409 here: they were) and unpaused.
        assert c.post("/wake_up").status_code in (200, 409)
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        assert c.post("/resume").status_code == 200
        assert c.get("/is_paused").json() == {"is_paused": False}


def fresh(http: httpx.Client, method: str, path: str, **kwargs) -> httpx.Response:
    """On a new connection: the kernel picks the API server (SO_REUSEPORT)."""
    return http.request(method, path, headers={**AUTH, "Connection": "close"}, **kwargs)


def views(http: httpx.Client) -> dict[int, dict]:
    """/server_info from each of the two API servers: its view of every engine."""
    seen: dict[int, dict] = {}
    for _ in range(200):
        info = fresh(http, "GET", "/server_info").json()
        seen[info["api_server_index"]] = info
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only API servers {sorted(seen)} answered")


def every_api_server_sees(http: httpx.Client, sleep_level: int, paused: bool) -> bool:
    return all(
        e["stats"]["sleep_level"] == sleep_level and e["stats"]["paused"] is paused
        for info in views(http).values()
        for e in info["engines"]
    )


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError(pid)


def engine_pids(http: httpx.Client) -> list[int]:
    return [e["pid"] for e in http.get("/server_info").json()["engines"]]


def completion(http: httpx.Client, prompt: str = "sleepy", max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **GREEDY}
    return http.post("/v1/completions", json=body)


# --- the routes, auth, shapes -----------------------------------------------------------

DEV_ROUTES = [
    ("GET", "/server_info", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/sleep?level=1", None),
    ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/collective_rpc", {"method": "ping"}),
    ("POST", "/pause?mode=keep", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
]


@pytest.mark.parametrize(("method", "path", "body"), DEV_ROUTES)
def test_every_dev_route_needs_the_api_key(deployment, http, method, path, body):
    url = deployment.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert_error(httpx.request(method, url, json=body, headers=headers, timeout=30), 401)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}  # nothing happened
    assert http.get("/is_paused").json() == {"is_paused": False}
    r = httpx.request(method, url, json=body, headers=AUTH, timeout=60)
    assert r.status_code == (409 if path == "/wake_up" else 200), r.text


def test_the_profiler_routes_are_absent_without_profiler_config(http):
    for path in ("/start_profile", "/stop_profile"):
        assert_error(http.post(path), 404)
    assert "/start_profile" not in http.get("/openapi.json").json()["paths"]


def test_server_info_keeps_its_shape_and_shows_each_engines_sleep_state(http):
    info = http.get("/server_info").json()
    assert set(info) == {
        "api_server_index", "api_server_count", "pid", "torch_imported",
        "engine_core_imported", "model", "max_model_len", "in_flight", "engines",
    }  # fmt: skip
    assert info["api_server_count"] == 2 and not info["torch_imported"]
    assert [e["rank"] for e in info["engines"]] == [0, 1]
    for engine in info["engines"]:
        assert engine["alive"] and engine["device"] == "cpu"
        assert engine["stats"]["sleep_level"] == 0 and engine["stats"]["paused"] is False


def test_reset_prefix_cache_forgets_the_cached_prefixes_of_every_engine(http):
    prompt = "a shared prefix long enough to fill several KV blocks " * 3

    def hits() -> list[int]:
        stats = http.post("/collective_rpc", json={"method": "get_stats"}).json()["results"]
        return [s["prefix_cache_hits"] for s in stats]

    for rank in ("0", "1"):
        for _ in range(2):  # the second time, the prefix comes from the cache
            r = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                headers={"X-data-parallel-rank": rank},
            )
            assert r.status_code == 200
    before = hits()
    assert all(h > 0 for h in before)
    r = http.post("/reset_prefix_cache", params={"reset_running_requests": "false"})
    assert r.status_code == 200
    assert [e["rank"] for e in r.json()["engines"]] == [0, 1]
    for rank in ("0", "1"):
        r = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
            headers={"X-data-parallel-rank": rank},
        )
        assert r.status_code == 200
    assert hits() == before  # nothing was left to hit
    assert_error(
        http.post("/reset_prefix_cache?reset_running_requests=maybe"),
        400,
        param="reset_running_requests",
    )


def test_collective_rpc_runs_allowed_methods_on_every_engine_and_refuses_the_rest(http):
    r = http.post("/collective_rpc", json={"method": "ping", "timeout": 30})
    assert r.json() == {"results": ["pong", "pong"]}
    usage = http.post("/collective_rpc", json={"method": "memory_usage"}).json()["results"]
    assert [u["kv_cache_bytes"] for u in usage] == [KV_BYTES, KV_BYTES]
    assert all(u["rss_bytes"] > KV_BYTES and u["weights_loaded"] for u in usage)
    assert (
        http.post("/collective_rpc", json={"method": "sleep_state"}).json()["results"]
        == [{"level": 0, "released": [], "paused": False}] * 2
    )
    for body, param in (
        ({"method": "load_weights"}, "method"),
        ({"method": "__init__"}, "method"),
        ({"method": "x" * 65}, "body.method"),
        ({}, "body.method"),
        ({"method": "ping", "args": ["1"]}, "body.args"),
        ({"method": "ping", "kwargs": {"a": "b"}}, "body.kwargs"),
        ({"method": "ping", "timeout": 0}, "timeout"),
        ({"method": "ping", "timeout": 1e9}, "timeout"),
    ):
        assert_error(http.post("/collective_rpc", json=body), 400, param=param)
    error = assert_error(http.post("/collective_rpc", json={"method": "sleep"}), 400)
    assert "allowed: ping" in error["message"]


# --- sleep mode -------------------------------------------------------------------------


def test_level_1_frees_each_engines_kv_cache_and_every_api_server_agrees(http):
    pids = engine_pids(http)
    awake = [rss(p) for p in pids]
    r = http.post("/sleep", params={"level": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["is_sleeping"] and [e["rank"] for e in body["engines"]] == [0, 1]
    asleep = [rss(p) for p in pids]
    for rank, (before, after, result) in enumerate(zip(awake, asleep, body["engines"])):
        print(
            f"engine {rank}: RSS awake {before / MiB:.1f} MiB, level-1 asleep {after / MiB:.1f} "
            f"MiB (freed {(before - after) / MiB:.1f} of a {KV_BYTES / MiB:.0f} MiB KV cache; "
            f"the engine measured {result['rss_freed_bytes']['kv_cache'] / MiB:.1f})"
        )
        assert result["kv_cache_bytes"] == KV_BYTES and result["released"] == ["kv_cache"]
        assert before - after >= 0.9 * KV_BYTES  # at least most of the KV cache went
    # Every API server knows, and the engines say so to any of them.
    wait_for(lambda: every_api_server_sees(http, 1, True), what="both API servers to know")
    for _ in range(6):
        assert fresh(http, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    # Generation is refused, clearly and at once; what needs no engine still works.
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
    ):
        r = fresh(http, "POST", path, json=body)
        assert_error(r, 503, contains=["asleep"])
        assert r.headers["retry-after"] == "5"
    assert http.post("/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 200
    assert http.get("/health").status_code == 200
    # Twice asleep is a conflict, and says why.
    assert_error(http.post("/sleep?level=2"), 409, contains=["already asleep at level 1"])
    r = http.post("/wake_up")
    assert r.status_code == 200 and r.json()["is_sleeping"] is False
    woken = [rss(p) for p in pids]
    for rank, (after, back) in enumerate(zip(asleep, woken)):
        print(f"engine {rank}: RSS after wake-up {back / MiB:.1f} MiB")
        assert back - after >= 0.9 * KV_BYTES
    wait_for(lambda: every_api_server_sees(http, 0, False), what="both API servers to know")
    assert_error(http.post("/wake_up"), 409, contains=["awake already"])
    assert completion(http).status_code == 200


def test_level_2_drops_the_weights_and_a_tagged_wake_up_reads_them_back(http):
    expected = completion(http, "the same text again", 12).json()["choices"][0]["text"]
    r = http.post("/sleep?level=2")
    assert r.status_code == 200
    for result in r.json()["engines"]:
        assert result["released"] == ["kv_cache", "weights"]
        assert result["memory_after"]["weights_loaded"] is False
    r = http.post("/wake_up", params={"tags": "weights"})
    assert r.status_code == 200 and r.json()["is_sleeping"] is True  # the KV cache is not back
    assert [e["restored"] for e in r.json()["engines"]] == [["weights"], ["weights"]]
    assert_error(completion(http), 503)
    r = http.post("/wake_up?tags=kv_cache&tags=kv_cache")
    assert r.status_code == 200 and r.json()["is_sleeping"] is False
    # Weights read again from disk: the model answers exactly as before.
    assert completion(http, "the same text again", 12).json()["choices"][0]["text"] == expected


def test_bad_sleep_and_wake_up_parameters_are_400s_naming_them(http):
    for query, param in (
        ("level=3", "level"),
        ("level=0", "level"),
        ("level=one", "level"),
        ("mode=later", "mode"),
    ):
        assert_error(http.post(f"/sleep?{query}"), 400, param=param)
    assert_error(http.post("/wake_up?tags=gpu"), 400, param="tags", contains=["gpu"])
    assert_error(http.post("/wake_up?" + "&".join(["tags=weights"] * 9)), 400, param="tags")
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


async def _stream(
    client, prompt: str, max_tokens: int, first: asyncio.Event | None, counts: dict | None = None
) -> tuple[str, str]:
    """A streamed completion's text and finish reason; `first` is set at its first token,
    `counts[prompt]` counts its chunks as they come."""
    text, reason = "", None
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
        if first is not None:
            first.set()
        if counts is not None:
            counts[prompt] = counts.get(prompt, 0) + 1
    return text, reason


async def _undisturbed(client, prompts: list[str]) -> list[str]:
    """The texts of the same greedy requests, run again with nothing in their way."""
    again = [
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=UNDER_LOAD_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        for p in prompts
    ]  # fmt: skip
    return [c.choices[0].text for c in await asyncio.gather(*again)]


def test_a_sleep_wake_cycle_under_load_loses_no_admitted_request(deployment):
    """mode=keep, level 2: requests in flight are frozen (their KV cache goes, the
    weights too, read again from disk on wake-up) and finish exactly as an undisturbed
    run of the same requests does (greedy; recomputed from prompt + output so far)."""
    prompts = [f"under load {i}" for i in range(8)]
    results, undisturbed = asyncio.run(_cycle_under_load(deployment, prompts))
    assert all(reason == "length" for _, reason in results)
    assert [text for text, _ in results] == undisturbed


async def _cycle_under_load(deployment: ZServe, prompts: list[str]) -> tuple[list, list]:
    firsts = [asyncio.Event() for _ in prompts]
    async with (
        async_client(deployment, api_key=KEY) as client,
        httpx.AsyncClient(base_url=deployment.base_url, headers=AUTH, timeout=60) as ahttp,
    ):
        # Long enough (~900 steps) that a fast machine is still generating at the sleep.
        tasks = [
            asyncio.create_task(_stream(client, p, UNDER_LOAD_TOKENS, e))
            for p, e in zip(prompts, firsts)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        try:
            r = await ahttp.post("/sleep", params={"level": 2, "mode": "keep"})
            assert r.status_code == 200, r.text
            kept = sum(e["preempted"] for e in r.json()["engines"])
            assert kept > 0  # requests were in flight when the engines fell asleep
            r = await ahttp.post(
                "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2}
            )
            assert r.status_code == 503 and r.headers["retry-after"]
            assert not all(t.done() for t in tasks)  # the kept ones wait for the wake-up
        finally:  # awake again whatever failed: the module's other tests share the engines
            assert (await ahttp.post("/wake_up")).status_code == 200
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        undisturbed = await _undisturbed(client, prompts)
    return results, undisturbed


def test_a_sleep_that_waits_lets_in_flight_requests_finish_first(deployment, http):
    results, engines = asyncio.run(_sleep_that_waits(deployment))
    assert all(reason == "length" for _, reason in results)
    assert [e["mode"] for e in engines] == ["wait", "wait"]


async def _sleep_that_waits(deployment: ZServe) -> tuple[list, list]:
    firsts = [asyncio.Event() for _ in range(4)]
    async with (
        async_client(deployment, api_key=KEY) as client,
        httpx.AsyncClient(base_url=deployment.base_url, headers=AUTH, timeout=120) as ahttp,
    ):
        tasks = [
            asyncio.create_task(_stream(client, f"wait {i}", 300, e)) for i, e in enumerate(firsts)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        sleeping = asyncio.create_task(ahttp.post("/sleep", params={"mode": "wait"}))
        # From the moment the engines drain, new requests are refused.
        while True:
            states = (await ahttp.post("/collective_rpc", json={"method": "sleep_state"})).json()
            if all(s["paused"] for s in states["results"]):
                break
            await asyncio.sleep(0.05)
        r = await ahttp.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503
        r = await asyncio.wait_for(sleeping, 120)
        assert r.status_code == 200, r.text
        assert all(t.done() for t in tasks)  # the sleep answered after its requests ended
        return await asyncio.gather(*tasks), r.json()["engines"]


def test_a_sleep_that_aborts_ends_in_flight_requests_with_a_503_never_a_hang(deployment, http):
    ended: dict[str, object] = {}

    def stream_one() -> None:
        with httpx.Client(base_url=deployment.base_url, headers=AUTH, timeout=120) as c:
            body = {"model": MODEL, "prompt": "abort me", "max_tokens": 1000, "stream": True}
            body |= GREEDY
            with c.stream("POST", "/v1/completions", json=body) as r:
                text = r.read().decode()
                ended["stream"] = (
                    parse_sse(text) if r.status_code == 200 else SSE([], [], True, text)
                )

    def plain_one() -> None:
        ended["plain"] = completion(http, "abort me too", 1000)

    threads = [threading.Thread(target=stream_one), threading.Thread(target=plain_one)]
    for t in threads:
        t.start()

    def in_engines() -> int:
        stats = http.post("/collective_rpc", json={"method": "get_stats"}).json()["results"]
        return sum(s["num_running"] + s["num_waiting"] for s in stats)

    wait_for(lambda: in_engines() >= 1, what="a request to run")
    r = http.post("/sleep?level=1")  # mode=abort: vLLM's default
    assert r.status_code == 200
    aborted = sum(e["aborted"] for e in r.json()["engines"])
    for t in threads:
        t.join(60)
        assert not t.is_alive()  # never a hang
    # Each ended: aborted by the sleep (a 503 saying so), refused because it came after
    # it (a 503 too), or, on a busy machine, finished before the sleep came.
    sse, plain = ended["stream"], ended["plain"]
    assert sse.done
    ends = []
    if "error" in sse.events[-1]:
        error = sse.events[-1]["error"]
        assert error["code"] == 503
        ends.append("aborted" if "put to sleep" in error["message"] else "refused")
    elif not sse.events:
        ends.append("refused")  # a 503 before the stream began
    else:
        ends.append("finished")
    if plain.status_code == 200:
        ends.append("finished")
    else:
        error = assert_error(plain, 503)
        assert plain.headers["retry-after"] == "5"
        ends.append("aborted" if "put to sleep" in error["message"] else "refused")
    assert 1 <= aborted == ends.count("aborted"), ends


# --- pause and resume ---------------------------------------------------------------------


def stats(http: httpx.Client) -> list[dict]:
    return http.post("/collective_rpc", json={"method": "get_stats"}).json()["results"]


def test_pause_keep_freezes_requests_in_flight_and_queues_new_ones_until_resume(deployment):
    """mode=keep: the streams stop where they are (KV cache kept), a request sent while
    paused is taken and waits (not a 503), and after /resume everything finishes exactly
    as an undisturbed run of the same requests does (greedy)."""
    prompts = [f"keep {i}" for i in range(4)]
    results, late, undisturbed = asyncio.run(_pause_keep(deployment, prompts))
    assert all(reason == "length" for _, reason in results) and late == "length"
    assert [text for text, _ in results] == undisturbed


async def _pause_keep(deployment: ZServe, prompts: list[str]) -> tuple[list, str, list]:
    counts: dict[str, int] = {}
    async with (
        async_client(deployment, api_key=KEY) as client,
        httpx.AsyncClient(base_url=deployment.base_url, headers=AUTH, timeout=60) as ahttp,
    ):
        tasks = [
            asyncio.create_task(_stream(client, p, UNDER_LOAD_TOKENS, None, counts))
            for p in prompts
        ]
        while len(counts) < len(prompts):
            await asyncio.sleep(0.02)
        try:
            r = await ahttp.post("/pause", params={"mode": "keep"})
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "paused"
            assert [e["mode"] for e in r.json()["engines"]] == ["keep", "keep"]
            assert (await ahttp.get("/is_paused")).json() == {"is_paused": True}
            late = asyncio.create_task(
                client.completions.create(model=MODEL, prompt="late", max_tokens=4)
            )
            await asyncio.sleep(0.5)  # whatever was on its way has arrived
            frozen, done = dict(counts), [t.done() for t in tasks]
            await asyncio.sleep(0.5)
            # Nothing was generated while paused (on a slow start, a stream may have
            # finished before the pause came: not all of them).
            assert counts == frozen and [t.done() for t in tasks] == done
            assert not late.done() and not all(done)
            r = await ahttp.post("/collective_rpc", json={"method": "get_stats"})
            assert sum(s["num_running"] for s in r.json()["results"]) == done.count(False)
            assert (await ahttp.get("/health")).status_code == 200
        finally:  # the module's other tests share the engines
            r = await ahttp.post("/resume")
            assert r.status_code == 200 and r.json()["status"] == "resumed"
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        late_reason = (await asyncio.wait_for(late, 60)).choices[0].finish_reason
        undisturbed = await _undisturbed(client, prompts)
    return results, late_reason, undisturbed


def test_pause_wait_answers_once_requests_in_flight_have_finished(deployment, http):
    finished_first, late_reason, engines = asyncio.run(_pause_wait(deployment))
    assert finished_first
    assert late_reason == "length"
    assert [(e["mode"], e["cache_cleared"]) for e in engines] == [("wait", False)] * 2


async def _pause_wait(deployment: ZServe) -> tuple[bool, str, list]:
    counts: dict[str, int] = {}
    prompts = [f"wait for me {i}" for i in range(2)]
    async with (
        async_client(deployment, api_key=KEY) as client,
        httpx.AsyncClient(base_url=deployment.base_url, headers=AUTH, timeout=120) as ahttp,
    ):
        tasks = [asyncio.create_task(_stream(client, p, 300, None, counts)) for p in prompts]
        while len(counts) < len(prompts):
            await asyncio.sleep(0.02)
        try:
            pausing = asyncio.create_task(
                ahttp.post("/pause", params={"mode": "wait", "clear_cache": "false"})
            )
            r = await asyncio.wait_for(pausing, 120)
            assert r.status_code == 200, r.text
            finished_first = all(t.done() for t in tasks)
            late = asyncio.create_task(
                client.completions.create(model=MODEL, prompt="late", max_tokens=4)
            )
            await asyncio.sleep(0.5)
            assert not late.done()  # taken, and held until the resume
        finally:
            assert (await ahttp.post("/resume")).status_code == 200
        late_reason = (await asyncio.wait_for(late, 60)).choices[0].finish_reason
        await asyncio.gather(*tasks)
    return finished_first, late_reason, r.json()["engines"]


def test_pause_abort_ends_requests_in_flight_with_a_503_and_clears_the_cache(deployment, http):
    ended: dict[str, httpx.Response] = {}
    one = threading.Thread(target=lambda: ended.update(r=completion(http, "abort me", 1000)))
    one.start()
    wait_for(lambda: sum(s["num_running"] for s in stats(http)) == 1, what="a request to run")
    try:
        r = http.post("/pause")  # mode=abort: vLLM's default
        assert r.status_code == 200, r.text
        engines = r.json()["engines"]
        assert [e["mode"] for e in engines] == ["abort", "abort"]
        assert all(e["cache_cleared"] for e in engines)
        one.join(60)
        assert not one.is_alive()  # never a hang
        if sum(e["aborted"] for e in engines):
            error = assert_error(ended["r"], 503)
            assert "was paused" in error["message"]
        else:  # a busy machine finished it before the pause came
            assert ended["r"].status_code == 200
        # While paused, a request is taken and waits; /health answers.
        late = threading.Thread(target=lambda: ended.update(late=completion(http, "later", 2)))
        late.start()
        wait_for(lambda: sum(s["num_waiting"] for s in stats(http)) == 1, what="a held request")
        assert late.is_alive() and http.get("/health").status_code == 200
    finally:
        assert http.post("/resume").status_code == 200
    late.join(60)
    assert ended["late"].status_code == 200, ended["late"].text


def test_a_resume_cancels_a_pause_still_waiting_and_bad_pause_parameters_are_400s(deployment, http):
    body = {"model": MODEL, "prompt": "long", "max_tokens": UNDER_LOAD_TOKENS, **GREEDY}
    answers: dict[str, httpx.Response] = {}
    running = threading.Thread(target=lambda: answers.update(run=http.post(
        "/v1/completions", json=body)))  # fmt: skip
    running.start()
    wait_for(lambda: sum(s["num_running"] for s in stats(http)) == 1, what="a request to run")
    pausing = threading.Thread(target=lambda: answers.update(pause=http.post(
        "/pause?wait_for_inflight_requests=true")))  # fmt: skip
    pausing.start()
    wait_for(lambda: http.get("/is_paused").json()["is_paused"], what="the pause")
    # A second pause while the first waits: refused by the engine that is draining.
    second = http.post("/pause?mode=keep")
    assert second.status_code in (200, 409)
    assert http.post("/resume").status_code == 200
    pausing.join(60)
    running.join(120)
    assert answers["run"].status_code == 200
    # The engine that ran the request says its pause was cancelled, unless a fast
    # machine had finished the request first; the other engine had paused at once.
    assert answers["pause"].status_code == 200
    refusals = [e["conflict"] for e in answers["pause"].json()["engines"] if "conflict" in e]
    assert refusals in ([], ["cancelled by a resume before the running requests finished"])
    for query, param in (
        ("mode=later", "mode"),
        ("mode=" + "x" * 10_000, "mode"),
        ("clear_cache=maybe", "clear_cache"),
        ("wait_for_inflight_requests=2", "wait_for_inflight_requests"),
        ("wait_for_inflight_requests=true&mode=keep", "mode"),
    ):
        error = assert_error(http.post(f"/pause?{query}"), 400, param=param)
        assert len(error["message"]) < 200
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.get("/health").status_code == 200


# --- POST /inference/v1/abort_requests ------------------------------------------------------


def test_abort_requests_ends_them_on_every_api_server_and_engine(deployment, http):
    """Streams on both API servers and both engines, each on its own connection; one
    abort, on whichever API server its connection lands, ends every one of them
    (vLLM's abort reaches only the requests of the API server it lands on).

    The engines are paused (mode keep) while the streams are placed and again once each
    has its first token, so that none can finish before the abort however slow the
    placement is: the abort ends running requests, frozen where they are."""
    body = {
        "token_ids": [1, 72, 80],
        "sampling_params": {"max_tokens": UNDER_LOAD_TOKENS, "ignore_eos": True},
        "stream": True,
    }
    with contextlib.ExitStack() as open_streams:
        streams: dict[str, tuple[httpx.Response, object]] = {}
        placed: set[tuple[str, str]] = set()
        assert http.post("/pause?mode=keep").status_code == 200
        for i in range(40):
            if len(placed) == 4:
                break
            c = open_streams.enter_context(
                httpx.Client(base_url=deployment.base_url, headers=AUTH, timeout=60)
            )
            headers = {"X-data-parallel-rank": str(i % 2)}
            r = open_streams.enter_context(
                c.stream(
                    "POST",
                    "/inference/v1/generate",
                    json={**body, "request_id": f"ab{i}"},
                    headers=headers,
                )
            )
            streams[f"generate-tokens-ab{i}"] = (r, r.iter_lines())
            placed.add((r.headers["x-api-server"], r.headers["x-engine-rank"]))
        assert len(placed) == 4, placed
        assert http.post("/resume").status_code == 200
        for _, lines in streams.values():
            assert next(lines).startswith("data: ")  # running: its first token is out
        assert http.post("/pause?mode=keep").status_code == 200
        assert sum(s["num_running"] for s in stats(http)) == len(streams)
        assert (
            http.post("/inference/v1/abort_requests", json={"request_ids": []}).status_code == 200
        )
        assert_error(
            httpx.post(deployment.base_url + "/inference/v1/abort_requests", json={}),
            401,
        )
        asked = [*streams, "never-sent"]
        r = fresh(http, "POST", "/inference/v1/abort_requests", json={"request_ids": asked})
        assert r.status_code == 200 and r.json() == {"aborted": sorted(streams, key=asked.index)}
        assert http.post("/resume").status_code == 200
        for rid, (_, lines) in streams.items():
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]", (rid, rest[-2:])
            events = [json.loads(line[len("data: ") :]) for line in rest[:-1]]
            assert events[-1]["choices"][0]["finish_reason"] == "abort", (rid, events[-1])
            generated = sum(len(c["token_ids"]) for e in events for c in e["choices"])
            assert generated < UNDER_LOAD_TOKENS
    wait_for(lambda: sum(s["num_running"] for s in stats(http)) == 0, what="the engines to idle")
    assert_error(http.post("/inference/v1/abort_requests", json={"request_ids": ["x"] * 1025}), 400)


# --- --wait-while-asleep ------------------------------------------------------------------


@pytest.fixture(scope="module")
def patient(tiny_model):
    with ZServe(
        str(tiny_model("llama")),
        *SERVED_NAMES,
        "--kv-cache-memory-bytes", "32MiB",
        "--device", "cpu",
        "--tokenizer-pool-size", "0",
        "--enable-dev-routes",
        "--wait-while-asleep", "120",
    ) as s:  # fmt: skip
        yield s


def test_with_wait_while_asleep_a_request_waits_for_the_wake_up(patient):
    with httpx.Client(base_url=patient.base_url, timeout=150) as c:
        assert c.post("/sleep").status_code == 200
        answer: dict[str, httpx.Response] = {}
        waiting = threading.Thread(target=lambda: answer.update(r=completion(c, "patient")))
        waiting.start()
        # It is in the server (an HTTP request in flight besides this one), not refused.
        wait_for(lambda: c.get("/server_info").json()["in_flight"] >= 2, what="the request")
        assert waiting.is_alive()
        assert c.post("/wake_up").status_code == 200
        waiting.join(60)
        assert answer["r"].status_code == 200, answer["r"].text
        assert answer["r"].json()["choices"][0]["finish_reason"] == "length"
