"""Issue 4 with the optional flags on (one server): items 1 (/tokenizer_info,
--metrics-prefix, /load), 3 (--chat-template, --trust-request-chat-template), 4
(--max-logprobs, generation_config defaults, --enable-prompt-tokens-details,
--enable-request-id-headers), 7 (--api-key, CORS) and 8 (--disable-log-*)."""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
import time

import anthropic
import httpx
import openai
import pytest
from e2e_http import (
    MAX_MODEL_LEN,
    MODEL,
    SERVED_NAMES,
    SMALL_KV,
    assert_error,
    engine_stats,
    post_stream,
    sync_client,
)
from e2e_otlp import OTLPCollector
from zserve_proc import ZServe, wait_for

pytestmark = pytest.mark.timeout(120)

KEY = "sk-flags-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://good.example"
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def flags_model(tiny_model, tmp_path_factory):
    """The tiny llama whose generation_config.json makes greedy decoding the default."""
    folder = tmp_path_factory.mktemp("flags-model") / "llama"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0}))
    return folder


@pytest.fixture(scope="module")
def collector():
    with OTLPCollector() as c:
        yield c


@pytest.fixture(scope="module")
def server(flags_model, tmp_path_factory, collector):
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    with ZServe(
        str(flags_model),
        *SERVED_NAMES,
        *SMALL_KV,
        "--api-key", KEY,
        "--enable-request-id-headers",
        "--enable-prompt-tokens-details",
        "--enable-force-include-usage",
        "--enable-tokenizer-info-endpoint",
        "--enable-server-load-tracking",
        "--allowed-origins", json.dumps([ORIGIN]),
        "--allowed-methods", "GET,POST",
        "--allowed-headers", "Authorization,Content-Type",
        "--allow-credentials",
        "--max-logprobs", "5",
        "--logprobs-mode", "processed_logprobs",
        "--otlp-traces-endpoint", collector.endpoint,
        "--metrics-prefix", "vllm",
        "--chat-template", str(template),
        "--trust-request-chat-template",
        "--disable-log-requests",
        "--disable-log-stats",
        "--enable-dev-routes",
        "--tokens-only",
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # spans leave within 0.1 s
    ) as s:  # fmt: skip
        s.started_at = time.monotonic()
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    with sync_client(server, api_key=KEY) as c:
        yield c


# --- --api-key (item 7) -----------------------------------------------------------------

GUARDED = [
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "u", "content": "x"}], "max_tokens": 1},
    ),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [65]}),
    ("POST", "/invocations", {"prompt": "x", "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("GET", "/load", None),
    ("GET", "/tokenizer_info", None),
    ("GET", "/openapi.json", None),
    ("GET", "/server_info", None),
    ("POST", "/inference/v1/generate", {"token_ids": [1], "sampling_params": {}}),
    ("POST", "/abort_requests", {"request_ids": []}),
]
OPEN = [
    ("GET", "/health"),
    ("GET", "/live"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/metrics/"),
]


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
def test_the_api_key_guards_every_route_but_the_probes(server, method, path, body):
    url = server.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert_error(r, 401)
    r = httpx.request(method, url, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("method", "path"), OPEN)
def test_probes_and_metrics_stay_open(server, method, path):
    assert httpx.request(method, server.base_url + path, timeout=30).status_code == 200


def test_the_bearer_scheme_is_matched_case_insensitively(server):
    """RFC 7235: the auth scheme is case-insensitive; the key itself is not."""
    url = server.base_url + "/v1/models"
    for scheme in ("bearer", "BEARER", "BeArEr"):
        r = httpx.get(url, headers={"Authorization": f"{scheme} {KEY}"}, timeout=30)
        assert r.status_code == 200, (scheme, r.text)
    r = httpx.get(url, headers={"Authorization": f"Bearer {KEY.upper()}"}, timeout=30)
    assert_error(r, 401)
    assert_error(httpx.get(url, headers={"Authorization": f"Basic {KEY}"}, timeout=30), 401)


def test_anthropics_x_api_key_header_carries_the_key_too(server):
    """Anthropic's clients send the key as x-api-key; a wrong or missing one is a 401."""
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0) as claude:
        m = claude.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert m.usage.output_tokens == 2
    url = server.base_url + "/v1/models"
    assert httpx.get(url, headers={"x-api-key": KEY}, timeout=30).status_code == 200
    for wrong in (KEY.upper(), "", KEY[:-1]):
        assert_error(httpx.get(url, headers={"x-api-key": wrong}, timeout=30), 401)
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )


def test_the_sdk_sees_a_wrong_key_as_an_authentication_error(server, client):
    with sync_client(server, api_key="wrong") as bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert [m.id for m in client.models.list().data][0] == MODEL


# --- CORS (item 7) ----------------------------------------------------------------------


def test_cors_preflight_answers_allowed_origins_only(server, default_server):
    preflight = {"Access-Control-Request-Method": "POST"}
    r = httpx.options(server.base_url + "/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert set(r.headers["access-control-allow-methods"].split(", ")) >= {"GET", "POST"}
    for refused in (
        {"Access-Control-Request-Method": "DELETE"},
        {**preflight, "Access-Control-Request-Headers": "X-Custom"},
    ):
        r = httpx.options(
            server.base_url + "/v1/completions", headers={"Origin": ORIGIN, **refused}
        )
        assert r.status_code == 400, refused
    r = httpx.options(
        server.base_url + "/v1/completions",
        headers={"Origin": "https://evil.example", **preflight},
    )
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.base_url + "/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    # No origin is allowed by default.
    r = httpx.get(default_server.base_url + "/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


# --- request ids (item 4) ---------------------------------------------------------------


def test_request_id_headers_are_echoed_or_made_up(http):
    r = http.get("/v1/models")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert (
        http.get("/v1/models", headers={"X-Request-Id": "mine"}).headers["x-request-id"] == "mine"
    )
    r = http.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "r1"}
    )
    assert r.headers["x-request-id"] == "r1" and r.json()["id"] == "cmpl-r1"
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "request_id": "b1"})
    assert r.headers["x-request-id"] == "b1"
    r, _ = post_stream(
        http, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "s1"}
    )
    assert r.headers["x-request-id"] == "s1"
    # An id that is no valid header value is still echoed, safely.
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "request_id": "é\n1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "%C3%A9%0A1"
    r = http.post("/v1/completions", json={"prompt": "x", "n": 0})
    assert_error(r, 400) and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


# --- usage details, logprob limits, defaults (item 4) -------------------------------------


def test_cached_prompt_tokens_are_reported(client):
    kwargs = dict(model=MODEL, prompt=[70] * 40, max_tokens=1)
    first = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet: 0, as vLLM
    second = client.completions.create(**kwargs)
    assert second.usage.prompt_tokens_details.cached_tokens == 32  # two full blocks
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


def test_cache_salt_isolates_the_prefix_cache(client, http):
    def cached(prompt, salt=None):
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    prompt = [71] * 40
    assert cached(prompt, "tenant-a") == 0
    assert cached(prompt, "tenant-a") == 32  # the same salt shares its blocks
    assert cached(prompt, "tenant-b") == 0  # another salt never does
    assert cached(prompt) == 0  # nor does no salt
    assert cached(prompt, "tenant-b") == 32
    assert cached(prompt, "m" * 1024) == 0  # the longest salt allowed
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": "s" * 1025})
    assert_error(r, 400) and "cache_salt" in r.text and "1024" in r.text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": 7})
    assert_error(r, 400) and "cache_salt" in r.text
    assert http.get("/health").status_code == 200


def test_force_include_usage_puts_usage_on_every_chunk_and_at_the_end(client):
    """vLLM's --enable-force-include-usage: as if include_usage and continuous_usage_stats
    were both set, whatever the request's stream_options say (issue 16, item 5)."""
    for options in (None, {"include_usage": False}):
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt="abc",
                max_tokens=3,
                stream=True,
                stream_options=options,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
        assert [c.usage.completion_tokens for c in chunks[:-1]] == [1, 2, 3]
        prompt = chunks[-1].usage.prompt_tokens
        assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_max_logprobs_is_the_servers_limit(client, http):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=5)
    assert r.choices[0].logprobs is not None
    for path, body, param in [
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 6}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "u", "content": "x"}], "logprobs": True, "top_logprobs": 6},
            "top_logprobs",
        ),
    ]:
        assert_error(http.post(path, json=body), 400, param, ["6", "--max-logprobs 5"])


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(client, http):
    """--logprobs-mode processed_logprobs: after top_k and temperature, two tokens are
    left, whose probabilities sum to 1; a greedy request's logit_bias shows in its own."""
    drawn = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, temperature=0.7, logprobs=5, seed=3,
        extra_body={"top_k": 2, "ignore_eos": True},
    )  # fmt: skip
    for top in drawn.choices[0].logprobs.top_logprobs:
        left = [v for v in top.values() if v > -9999.0]  # the others are -inf, clamped
        assert len(left) == 2 and math.isclose(sum(map(math.exp, left)), 1.0, rel_tol=1e-3)
    biased = http.post(
        "/v1/completions",
        json={"prompt": "abc", "max_tokens": 3, "temperature": 0, "logprobs": 1,
              "logit_bias": {"65": 100}, "return_tokens_as_token_ids": True},
    ).json()["choices"][0]["logprobs"]  # fmt: skip
    assert biased["tokens"] == ["token_id:65"] * 3
    assert all(lp > -1e-3 for lp in biased["token_logprobs"])  # raw: about -log(320)


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_each_choice_is_a_span_under_the_callers_trace(http, collector):
    """--otlp-traces-endpoint: a request with a W3C traceparent gives one llm_request
    span per choice, children of the caller's span, with vLLM's gen_ai attributes; one
    without starts a trace of its own."""
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "traced-1"}
    body = {"prompt": "abc", "max_tokens": 5, "n": 2, "temperature": 0.5, "top_p": 0.9,
            "ignore_eos": True}  # fmt: skip
    assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
    body = {"prompt": "abcd", "max_tokens": 3}
    assert (
        http.post("/v1/completions", json=body, headers={"x-request-id": "own"}).status_code == 200
    )
    wait_for(
        lambda: (
            len(collector.with_attribute("gen_ai.request.id", "traced-1")) == 2
            and collector.with_attribute("gen_ai.request.id", "own")
        ),
        timeout=20,
        what="the spans at the collector",
    )
    traced = collector.with_attribute("gen_ai.request.id", "traced-1")
    for span in traced:
        assert span.name == "llm_request" and span.kind == 2  # SPAN_KIND_SERVER
        assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
        a = span.attributes
        assert a["gen_ai.response.model"] == MODEL and a["gen_ai.request.n"] == 2
        assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.usage.completion_tokens"] == 5
        assert (
            a["gen_ai.request.temperature"] == 0.5 and abs(a["gen_ai.request.top_p"] - 0.9) < 1e-6
        )
        assert a["gen_ai.usage.prompt_tokens"] > 0
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        latency = {k.rsplit(".", 1)[1]: v for k, v in a.items() if k.startswith("gen_ai.latency.")}
        assert 0 <= latency["time_in_queue"] <= latency["time_to_first_token"] <= latency["e2e"]
        assert abs(span.end_ns - span.start_ns - latency["e2e"] * 1e9) < 1e6
        assert span.resource["zserve.api_server"] == 0
    assert len({s.span_id for s in traced}) == 2
    (own,) = collector.with_attribute("gen_ai.request.id", "own")
    assert own.trace_id not in (TRACE_ID, "0" * 32) and own.parent_span_id == ""


@pytest.mark.parametrize(
    "traceparent, tracestate",
    [("00-zz-yy-01", "a=b"), (f"00-{'0' * 32}-{'0' * 16}-01", ""), ("x" * 4000, "k=v," * 900)],
)
def test_a_malformed_trace_context_starts_a_trace_of_its_own(
    http, collector, traceparent, tracestate
):
    rid = f"bad-trace-{len(traceparent)}-{len(tracestate)}"
    headers = {"traceparent": traceparent, "tracestate": tracestate, "x-request-id": rid}
    body = {"prompt": "abc", "max_tokens": 2}
    assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
    wait_for(lambda: collector.with_attribute("gen_ai.request.id", rid), timeout=20)
    (span,) = collector.with_attribute("gen_ai.request.id", rid)
    assert span.parent_span_id == "" and span.trace_id != "0" * 32
    assert http.get("/health").status_code == 200


def test_generation_config_supplies_defaults_that_requests_override(client):
    kwargs = dict(model=MODEL, prompt="abc", max_tokens=12, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kwargs, temperature=0).choices[0].text
    defaults = {client.completions.create(**kwargs).choices[0].text for _ in range(3)}
    assert defaults == {greedy}  # generation_config.json says temperature 0.0
    sampled = {
        client.completions.create(**kwargs, temperature=1.0, seed=s).choices[0].text
        for s in range(3)
    }
    assert len(sampled) > 1


# --- routes behind flags (item 1) -----------------------------------------------------------


def test_tokenizer_info_describes_the_tokenizer(http):
    info = http.get("/tokenizer_info").json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert info["model_max_length"] >= MAX_MODEL_LEN
    assert info["eos_token"] == "<|im_end|>"
    assert info["chat_template"]


def test_metrics_prefix_vllm_gives_vllms_names(http):
    http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    text = httpx.get(str(http.base_url) + "/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert "vllm:num_requests_running" in names
    assert "vllm:time_to_first_token_seconds_count" in names
    assert "vllm:request_success_total" in names
    assert not any(n.startswith("zserve:") for n in names)


def test_load_counts_requests_in_flight(server, http):
    assert http.get("/load").json() == {"server_load": 0}

    def stream(i: int) -> None:
        body = {"prompt": [80 + i] * 4, "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60
        ) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    # Two 900-token streams of the tiny model can finish within a few polls on a busy
    # machine: an attempt polls until both streams end, and counts once it saw both;
    # then the client leaves both streams, which must release them.
    stop = threading.Event()
    seen: list[set[int]] = []
    for _ in range(5):
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        loads = set()
        try:
            while any(t.is_alive() for t in threads) and 2 not in loads:
                loads.add(http.get("/load").json()["server_load"])
        finally:
            stop.set()
            for t in threads:
                t.join()
            stop.clear()
        seen.append(loads)
        assert max(loads) <= 2, seen
        if 2 in loads:
            break
    assert 2 in seen[-1], f"never saw both streams in flight: {seen}"
    wait_for(lambda: http.get("/load").json()["server_load"] == 0, what="load back to 0")
    # A stream that runs to its end is released too.
    _, sse = post_stream(http, "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert sse.done and http.get("/load").json() == {"server_load": 0}
    assert engine_stats(server, AUTH)["num_running"] == 0


# --- chat templates (item 3) -------------------------------------------------------------


def test_the_chat_template_flag_replaces_the_models_template(http, client):
    messages = [{"role": "user", "content": "hi"}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert bytes(tokens).decode() == "[user]hi[assistant]"
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens == len("[user]hi[assistant]")


def test_a_trusted_request_may_bring_its_own_template(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=1,
        extra_body={"chat_template": "{{ messages[0].content }}!"},
    )
    assert r.usage.prompt_tokens == len("hello!")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=1,
            extra_body={"chat_template": "{% for %}"},
        )
    assert e.value.body["param"] == "messages" and "template" in e.value.body["message"]


# --- logs (item 8) ---------------------------------------------------------------------


def test_disabled_request_and_stats_logs_stay_quiet(server, http):
    # The stats line comes every 10 s while there is traffic: make sure a window passed.
    while time.monotonic() - server.started_at < 12:
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        time.sleep(0.5)
    log = server.log()
    assert "zserve.stats" not in log
    assert not re.search(r"zserve\.api: request \S+: \d+ choice", log)
    assert "Traceback" not in log


# --- --tokens-only ------------------------------------------------------------------------


def test_tokens_only_generates_ids_and_refuses_what_needs_the_text(http):
    body = {"token_ids": [1, 72, 80], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    for extra, param in (
        ({"sampling_params": {"stop": ["a"]}}, "sampling_params.stop"),
        ({"output_mode": "text"}, "output_mode"),
    ):
        error = assert_error(http.post("/inference/v1/generate", json={**body, **extra}), 400)
        assert error["param"] == param and "--tokens-only" in error["message"]
    r = http.post("/abort_requests", json={"request_ids": ["nobody"]})
    assert r.status_code == 200 and r.json() == {"aborted": []}
