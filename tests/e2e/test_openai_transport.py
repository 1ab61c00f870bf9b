"""Issue 4 on a server that waits a lot (--max-num-seqs 1): items 6 (keep-alive comments;
errors after HTTP 200 when the engine dies), 7 (TLS, --root-path, --middleware,
ZSERVE_API_KEY), 8 (the stats and request log lines), 9 (admission limits), the
priority headers of item 4 at work, the KV-cache limit of item 5, and
--disable-fastapi-docs. The engine is killed by the last test."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from e2e_http import MODEL, SERVED_NAMES, assert_error, metric_samples, parse_sse
from e2e_tls import CertificateAuthority, TLSServer, client_context, have_openssl
from zserve_proc import wait_for

pytestmark = pytest.mark.timeout(120)

KEY = "sk-from-the-environment"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = "/api"
KV_TOKENS = 63 * 16 + 1  # 512 KiB: 64 blocks of 16 tokens, one of them the null block
MAX_QUEUED_REQS, MAX_QUEUED_TOKENS = 3, 1000

MIDDLEWARE = """
from starlette.types import ASGIApp


class AddHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-user-class", b"yes")]
            await send(message)

        await self.app(scope, receive, send_with_header)


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-user-function"] = "yes"
    return response
"""


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path, Path] | None:
    """(key, certificate, CA certificate) for 127.0.0.1, or None without openssl."""
    if not have_openssl():
        return None
    authority = CertificateAuthority(tmp_path_factory.mktemp("tls"))
    return (*authority.issue("server", server=True), authority.cert)


@pytest.fixture(scope="module")
def server(tiny_model, certificate, tmp_path_factory):
    tls = ()
    context = None
    if certificate is not None:
        key, cert, ca = certificate
        tls = ("--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
        context = client_context(ca)
    modules = tmp_path_factory.mktemp("middleware")
    (modules / "zserve_test_middleware.py").write_text(MIDDLEWARE)
    path = os.pathsep.join(p for p in [str(modules), os.environ.get("PYTHONPATH")] if p)
    with TLSServer(
        str(tiny_model("llama")),
        *SERVED_NAMES,
        "--kv-cache-memory-bytes", "512KiB",
        "--device", "cpu",
        "--max-num-seqs", "1",
        "--scheduling-policy", "priority",
        "--sse-keep-alive-interval", "0.2",
        "--max-num-queued-reqs", str(MAX_QUEUED_REQS),
        "--max-num-queued-tokens", str(MAX_QUEUED_TOKENS),
        "--root-path", ROOT,
        "--middleware", "zserve_test_middleware.AddHeader",
        "--middleware", "zserve_test_middleware.stamp",
        *tls,
        "--disable-fastapi-docs",
        "--enable-log-requests",
        "--enable-dev-routes",  # /server_info, /pause, /resume
        context=context,
        env={"ZSERVE_API_KEY": KEY, "PYTHONPATH": path},
    ) as s:  # fmt: skip
        s.started_at = time.monotonic()
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.base_url, headers=AUTH, verify=server.verify, timeout=60
    ) as c:
        yield c


def labelled(http: httpx.Client, name: str, label: str) -> dict[str, float]:
    """The series of one /metrics name by the value of one label."""
    samples = metric_samples(http.get("/metrics").text)
    return {
        key.split(f'{label}="', 1)[1].split('"', 1)[0]: value
        for key, value in samples.items()
        if key.startswith(name + "{")
    }


def rejections(http: httpx.Client) -> dict[str, float]:
    return labelled(http, "zserve:admission_rejections_total", "reason")


def stats(http: httpx.Client) -> dict:
    return http.get("/server_info").json()["engines"][0]["stats"]


class Blocker:
    """A stream that holds the engine's only running slot until released: once it runs,
    the engine is paused in mode keep (POST /pause), so it stays there, prefilled, and
    every request after it waits, however fast the machine."""

    def __init__(self, http: httpx.Client, prompt: list[int] | None = None) -> None:
        body = {
            "prompt": prompt or [66] * 4,
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
        self.stack = ExitStack()
        self.stack.callback(lambda: http.post("/resume").raise_for_status())
        try:
            # Both kept: a dropped line iterator would close the stream (an abort).
            self.response = self.stack.enter_context(
                http.stream("POST", "/v1/completions", json=body)
            )
            self.lines = self.response.iter_lines()
            while not next(self.lines).startswith("data: "):
                pass
            http.post("/pause", params={"mode": "keep"}).raise_for_status()
        except BaseException:
            self.stack.close()
            raise

    def release(self) -> None:
        """The stream ends (an abort), then the engine resumes; a second call does
        nothing."""
        self.stack.close()


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args)
        except Exception as e:  # reported by the test that joins the thread
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, result


# --- transport (item 7) ---------------------------------------------------------------


def test_tls_serves_https_only(server, http):
    if server.context is None:
        pytest.skip("openssl is needed to make a TLS certificate")
    assert http.get("/health").status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    with (
        httpx.Client(verify=server.verify) as tls,
        openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=KEY, http_client=tls, max_retries=0
        ) as client,
    ):
        assert [m.id for m in client.models.list().data][0] == MODEL


def test_the_api_key_comes_from_the_environment(server, http):
    with httpx.Client(base_url=server.base_url, verify=server.verify) as anonymous:
        assert_error(anonymous.get("/v1/models"), 401)
        assert anonymous.get("/health").status_code == 200
    assert http.get("/v1/models").status_code == 200


def test_root_path_serves_the_app_with_and_without_the_prefix(server, http):
    """--root-path (issue 16, item 3): as vLLM, every route answers both with the
    proxy's prefix and without it; the API key and the probes see the same routes."""
    for prefix in ("", ROOT):
        assert http.get(prefix + "/v1/models").status_code == 200
        r = http.post(prefix + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
        with openai.OpenAI(
            base_url=server.base_url + prefix + "/v1",
            api_key=KEY,
            http_client=httpx.Client(verify=server.verify),
            max_retries=0,
        ) as client:
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
            assert chat.choices[0].finish_reason == "length"
        anonymous = httpx.get(server.base_url + prefix + "/health", verify=server.verify)
        assert anonymous.status_code == 200
        anonymous = httpx.get(server.base_url + prefix + "/v1/models", verify=server.verify)
        assert_error(anonymous, 401)
    assert_error(http.get(ROOT + "x/v1/models"), 404)  # a longer first segment is no prefix
    assert_error(http.get(ROOT + ROOT + "/v1/models"), 404)


def test_disable_fastapi_docs_removes_the_openapi_document(http):
    assert_error(http.get("/openapi.json"), 404)


def test_user_middleware_wraps_every_response(http):
    for r in [
        http.get("/health"),
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}),
        http.post("/v1/completions", json={"prompt": "x", "n": 0}),
    ]:
        assert r.headers["x-user-class"] == "yes" and r.headers["x-user-function"] == "yes"
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
    ) as r:
        assert r.headers["x-user-function"] == "yes"
        assert parse_sse(r.read().decode()).done


# --- the KV cache is a limit like the context length (item 5) -----------------------------


def test_a_request_larger_than_the_kv_cache_stops_at_it_not_in_an_engine_error(http):
    """The KV cache is a limit like the context (issue 16, item 1): max_tokens past it
    is cut to it; a prompt that fills it is a 400."""
    prompt = [65] * (KV_TOKENS - 10)
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 11, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == KV_TOKENS
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/completions", json={"prompt": [65] * KV_TOKENS, "max_tokens": 1})
    assert_error(r, 400, "input_tokens", [f"KV cache holds at most {KV_TOKENS} tokens"])
    # Chat's default max_tokens stops at the KV limit too.
    messages = [{"role": "user", "content": "y" * 960}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == KV_TOKENS


# --- streams wait with keep-alive comments (item 6) -----------------------------------------


def test_a_waiting_stream_gets_keep_alive_comments(http, server):
    blocker = Blocker(http)
    try:
        t, result = in_thread(
            lambda: (
                http.post(
                    "/v1/completions",
                    json={"prompt": "abc", "max_tokens": 3, "stream": True},
                    timeout=60,
                ).text
            )
        )
        wait_for(lambda: stats(http)["num_waiting"] == 1, what="a waiting request")
        time.sleep(0.7)  # a few keep-alive intervals
    finally:
        blocker.release()
    t.join()
    sse = parse_sse(result["value"])
    assert "keep-alive" in sse.comments
    assert sse.done and sse.events
    # The official client skips the comments.
    blocker = Blocker(http)
    with (
        httpx.Client(verify=server.verify) as tls,
        openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=KEY, http_client=tls, max_retries=0
        ) as client,
    ):

        def stream_text():
            chunks = client.completions.create(
                model=MODEL, prompt="abc", max_tokens=3, stream=True, temperature=0
            )
            return [c.choices[0].text for c in chunks]

        t, result = in_thread(stream_text)
        wait_for(lambda: stats(http)["num_waiting"] == 1, what="a waiting request")
        time.sleep(0.5)
        blocker.release()
        t.join()
    assert "error" not in result and len(result["value"]) >= 1


# --- priority headers at work (item 4) -------------------------------------------------------


def test_the_x_priority_header_overtakes_the_body_priority(http):
    order: list[str] = []

    def post(name: str, headers: dict) -> None:
        http.post(
            "/v1/completions",
            json={"prompt": name, "max_tokens": 20, "ignore_eos": True, "priority": 10},
            headers=headers,
        ).raise_for_status()
        order.append(name)

    blocker = Blocker(http)
    try:
        late, _ = in_thread(post, "body", {})
        wait_for(lambda: stats(http)["num_waiting"] == 1, what="the first waiting request")
        early, _ = in_thread(post, "header", {"X-Priority": "-5"})
        wait_for(lambda: stats(http)["num_waiting"] == 2, what="the second waiting request")
    finally:
        blocker.release()
    late.join()
    early.join()
    assert order == ["header", "body"]


# --- admission (item 9) ----------------------------------------------------------------


def test_admission_limits_are_503s_with_retry_after_before_any_stream(http):
    rejected_before = rejections(http)
    blocker = Blocker(http)  # 1 request, prefilled: its prompt no longer counts
    threads = []
    try:
        waiting = {"prompt": [67] * 600, "max_tokens": 2}
        threads.append(in_thread(lambda: http.post("/v1/completions", json=waiting)))
        wait_for(lambda: stats(http)["num_waiting"] == 1, what="a waiting request")
        r = http.post("/v1/completions", json={"prompt": [68] * 600, "max_tokens": 2})
        assert_error(r, 503, contains=["--max-num-queued-tokens", str(MAX_QUEUED_TOKENS)])
        assert r.headers["retry-after"]
        small = {"prompt": [69] * 10, "max_tokens": 2}
        threads.append(in_thread(lambda: http.post("/v1/completions", json=small)))
        wait_for(lambda: stats(http)["num_waiting"] == 2, what="two waiting requests")
        for stream in (False, True):
            body = {"prompt": "x", "max_tokens": 2, "stream": stream}
            r = http.post("/v1/completions", json=body)
            assert_error(r, 503, contains=["--max-num-queued-reqs", str(MAX_QUEUED_REQS)])
            assert r.headers["retry-after"]
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        assert_error(http.post("/v1/chat/completions", json=chat), 503)
        # vLLM's metrics of it (issue 16, item 14): rejections by limit, waiting by reason.
        after = rejections(http)
        assert after["max_num_queued_tokens"] == rejected_before["max_num_queued_tokens"] + 1
        assert after["max_num_queued_reqs"] == rejected_before["max_num_queued_reqs"] + 3
        by_reason = labelled(http, "zserve:num_requests_waiting_by_reason", "reason")
        assert by_reason == {"capacity": 2.0, "deferred": 0.0}
    finally:
        blocker.release()
    for t, result in threads:
        t.join()
        assert result["value"].status_code == 200
    # Everything was released, streams included: the full budget is there again.
    wait_for(lambda: stats(http)["num_running"] == 0, what="an idle engine")
    blocker = Blocker(http)
    try:
        t, result = in_thread(lambda: http.post("/v1/completions", json=waiting))
        wait_for(lambda: stats(http)["num_waiting"] == 1, what="a waiting request")
        assert http.get("/health").status_code == 200
    finally:
        blocker.release()
    t.join()
    assert result["value"].status_code == 200


# --- logs (item 8) ---------------------------------------------------------------------


def test_the_stats_line_and_with_enable_log_requests_request_lines_are_logged(server, http):
    def logged() -> bool:
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        return "zserve.stats: engine 0: running" in server.log()

    wait_for(logged, timeout=25, interval=1.0, what="the periodic stats line")
    line = next(x for x in server.log().splitlines() if "zserve.stats: engine 0" in x)
    for part in ["running", "waiting", "prompt", "generation", "tok/s", "KV cache", "prefix-cache"]:
        assert part in line
    assert re.search(r"zserve\.api: request \S+: 1 choice\(s\)", server.log())


# --- an engine that dies mid-stream (item 6); leaves the server broken: keep last ---------


def test_errors_after_http_200_end_the_stream_with_an_error_event_and_done(server, http):
    info = http.get("/server_info").json()
    engine_pid = info["engines"][0]["pid"]
    body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        t, result = in_thread(lambda: http.post("/v1/completions", json=body))
        wait_for(lambda: stats(http)["num_waiting"] == 1, what="a second request")
        os.kill(engine_pid, signal.SIGKILL)
        rest = "\n".join(lines) + "\n"
    events = [x for x in rest.split("\n\n") if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = parse_sse(events[-2] + "\n\n").events[0]
    assert set(error) == {"error"} and error["error"]["code"] >= 500
    assert "engine" in error["error"]["message"]
    t.join()
    assert_error(result["value"], range(500, 600))
    assert httpx.get(server.base_url + "/health", verify=server.verify).status_code == 503
