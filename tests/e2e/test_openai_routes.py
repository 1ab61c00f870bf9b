"""Issue 4, item 1: every route of a text-generation server, on default flags.

Flag-gated routes (/tokenizer_info, /load counting, --metrics-prefix) are in
test_openai_flags.py; --disable-fastapi-docs in test_openai_transport.py.
"""

from __future__ import annotations

import re
import threading
from contextlib import ExitStack

import httpx
import pytest
from e2e_http import (
    ALIAS,
    MAX_MODEL_LEN,
    MODEL,
    assert_error,
    engine_stats,
    metric_samples,
    post_stream,
)
from zserve_proc import wait_for

from frontend.app import served_routes
from frontend.config import FrontendConfig
from frontend.openai_models import ChatCompletionRequest, CompletionRequest, TokenizeRequest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tiny_model("llama")))


def test_models_lists_every_served_name_with_the_context_length(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    assert all(m.object == "model" for m in models.data)
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_health_live_and_ping_answer_200_with_an_empty_body(http):
    for method, path in [("GET", "/health"), ("GET", "/live"), ("GET", "/ping"), ("POST", "/ping")]:
        r = http.request(method, path)
        assert r.status_code == 200, (method, path)
        assert r.content == b"", (method, path)


def test_version_is_exactly_one_string_field(http):
    body = http.get("/version").json()
    assert list(body) == ["version"] and isinstance(body["version"], str)


def test_load_stays_zero_without_server_load_tracking(default_server, http):
    # /load counts nothing unless --enable-server-load-tracking, even while a request
    # is in flight. The tiny model can stream its longest request in well under a
    # second, so on a busy machine the request may finish before /load is read; an
    # attempt counts only when the engine still runs the request after /load answered,
    # and /load must be 0 in every attempt. The thread records how its stream went, so
    # a failed stream says why instead of timing out.
    attempts = []
    for _ in range(5):
        first_event = threading.Event()
        seen: dict = {}

        def long_stream(first_event=first_event, seen=seen):
            try:
                with httpx.stream(
                    "POST",
                    default_server.base_url + "/v1/completions",
                    json={
                        "prompt": "x",
                        "max_tokens": MAX_MODEL_LEN - 8,
                        "ignore_eos": True,
                        "stream": True,
                    },
                    timeout=60,
                ) as r:
                    seen["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            first_event.set()
                        if line:
                            seen["last"] = line
            except Exception as e:  # reported by the assertion below
                seen["error"] = repr(e)
            finally:
                first_event.set()

        t = threading.Thread(target=long_stream)
        t.start()
        try:
            assert first_event.wait(30), "the stream sent no event within 30 s"
            load = http.get("/load").json()
            running = engine_stats(default_server)["num_running"]
        finally:
            t.join()
        assert seen.get("status") == 200 and "error" not in seen, seen
        assert seen.get("last") == "data: [DONE]", seen
        assert load == {"server_load": 0}, load
        attempts.append(running)
        # Only this test's request can run on the shared server.
        if running == 1:
            break
    assert attempts[-1] == 1, (
        f"the request finished before /load answered in every attempt: {attempts}"
    )


def test_requests_are_not_logged_line_by_line_by_default(default_server, http):
    # vLLM's default since 0.10 (--enable-log-requests turns the lines on).
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200
    assert not re.search(r"zserve\.api: request \S+: \d+ choice\(s\)", default_server.log())


def test_tokenizer_info_is_off_by_default(http):
    assert_error(http.get("/tokenizer_info"), 404)


def test_unknown_route_and_wrong_method_get_json_errors(http):
    assert_error(http.get("/v1/nope"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.delete("/v1/chat/completions"), 405)


# --- /tokenize, /detokenize (§5 items 48-51) ----------------------------------------


def test_tokenize_a_prompt_equals_the_hf_tokenizer(http, hf_tokenizer):
    prompt = "Hello, my name is zserve — ünïcode"
    for add_special in (True, False):
        r = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": add_special})
        body = r.json()
        expected = hf_tokenizer.encode(prompt, add_special_tokens=add_special)
        assert body == {
            "count": len(expected),
            "max_model_len": MAX_MODEL_LEN,
            "tokens": expected,
            "token_strs": None,
        }


def test_tokenize_messages_equals_the_chat_template(http, hf_tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    for add_generation_prompt, continue_final in [(True, False), (False, True), (False, False)]:
        r = http.post(
            "/tokenize",
            json={
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final,
                "add_special_tokens": False,
            },
        )
        text = hf_tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
        )
        expected = hf_tokenizer.encode(text, add_special_tokens=False)
        assert r.json()["tokens"] == expected


def test_tokenize_returns_token_strings_on_request(http, hf_tokenizer):
    body = http.post("/tokenize", json={"prompt": "a b\n", "return_token_strs": True}).json()
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(body["tokens"])


def test_tokenize_passes_chat_template_kwargs_to_the_template(http):
    messages = [{"role": "user", "content": "hi"}]
    plain = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    off = http.post(
        "/tokenize",
        json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()["tokens"]
    assert off == plain + list(b"<think>\n\n</think>\n\n")


def test_detokenize_returns_exactly_the_prompt(http):
    r = http.post("/detokenize", json={"tokens": list("héllo".encode())})
    assert r.json() == {"prompt": "héllo"}


# --- /invocations (SageMaker) ---------------------------------------------------------


def test_invocations_dispatches_a_chat_body_like_chat_completions(http):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    chat = http.post("/v1/chat/completions", json=body).json()
    inv = http.post("/invocations", json=body).json()
    assert inv["object"] == "chat.completion"
    assert set(inv) == set(chat)
    assert inv["choices"] == chat["choices"]


def test_invocations_dispatches_a_prompt_body_like_completions(http):
    body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    completion = http.post("/v1/completions", json=body).json()
    inv = http.post("/invocations", json=body).json()
    assert inv["object"] == "text_completion"
    assert set(inv) == set(completion)
    assert inv["choices"] == completion["choices"]


def test_invocations_streams_too(http):
    with http.stream(
        "POST", "/invocations", json={"prompt": "ab", "max_tokens": 3, "stream": True}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.read().decode().endswith("data: [DONE]\n\n")


def test_invocations_refuses_bodies_it_cannot_dispatch(http):
    assert_error(http.post("/invocations", json={"input": "x"}), 400)
    assert_error(http.post("/invocations", content=b"{nope", headers=_JSON), 400)
    r = http.post("/invocations", content=b"a=b", headers={"content-type": "text/plain"})
    assert_error(r, range(400, 500))
    # Validation errors are the dispatched route's own.
    assert_error(
        http.post("/invocations", json={"prompt": "x", "n": 0}), 400, param="n", contains=["n"]
    )


_JSON = {"content-type": "application/json"}


# --- /openapi.json ---------------------------------------------------------------------


def test_openapi_document_is_generated_from_the_request_models(http):
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]:
        assert "post" in doc["paths"][path], path
    schemas = doc["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields), model
    # One route table: every route the server answers is documented, nothing else is
    # (the default server has the development and scale-out routes, not the profiler's).
    served = served_routes(
        FrontendConfig("", "", [], enable_dev_routes=True, enable_scale_out=True)
    )
    assert {"/server_info", "/sleep"} <= set(doc["paths"])
    assert set(doc["paths"]) == {route.path for route in served}
    for route in served:
        assert set(doc["paths"][route.path]) == {m.lower() for m in route.methods}


# --- /metrics (§5 items 53-55) -------------------------------------------------------

# Every §4 name of the research note but the newer/optional/LoRA ones.
_REQUIRED_METRICS = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count",
    "request_time_per_output_token_seconds_count",
    "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count",
    "request_inference_time_seconds_count",
    "request_prefill_time_seconds_count",
    "request_decode_time_seconds_count",
    "request_prompt_tokens_bucket",
    "request_generation_tokens_sum",
    "request_params_max_tokens_sum",
    "request_params_n_count",
]


def test_metrics_is_prometheus_text_with_vllms_names_under_zserve(http):
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {line.split("{")[0].split(" ")[0] for line in r.text.splitlines() if line[:1] != "#"}
    for name in _REQUIRED_METRICS:
        assert "zserve:" + name in names, name
    assert not any(n.startswith("vllm:") for n in names)
    slash = http.get("/metrics/", follow_redirects=False)
    assert slash.status_code == 200


def test_metrics_has_the_iteration_cache_config_and_max_generation_series(http):
    text = http.get("/metrics").text
    for name in [
        "zserve:iteration_tokens_total_count",
        "zserve:cache_config_info",
        "zserve:request_max_num_generation_tokens_count",
    ]:
        assert name in text, name


def test_metrics_count_ten_requests_like_vllm(http):
    """§5 item 54: 10 sequential completions of P prompt tokens and 10 output tokens."""
    prompt_len, n_req, out = 12, 10, 10
    before = metric_samples(http.get("/metrics").text)
    for i in range(n_req):
        r = http.post(
            "/v1/completions",
            json={"prompt": [40 + i] * prompt_len, "max_tokens": out, "ignore_eos": True},
        )
        assert r.json()["usage"]["completion_tokens"] == out
    after = metric_samples(http.get("/metrics").text)

    def delta(name: str) -> float:
        return after.get("zserve:" + name, 0.0) - before.get("zserve:" + name, 0.0)

    assert delta("time_to_first_token_seconds_count") == n_req
    assert delta("inter_token_latency_seconds_count") == n_req * (out - 1)
    for name in [
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_time_per_output_token_seconds",
        "request_params_n",
    ]:
        assert delta(name + "_count") == n_req, name
    assert delta("request_prompt_tokens_sum") == n_req * prompt_len
    assert delta("request_generation_tokens_sum") == n_req * out
    assert delta("request_params_max_tokens_sum") == n_req * out
    assert delta("prompt_tokens_total") == n_req * prompt_len
    assert delta("generation_tokens_total") == n_req * out
    assert delta("request_success_total") == n_req
    assert delta("request_max_num_generation_tokens_count") == n_req
    # per engine step: a prefill step computes P prompt tokens and makes 1; decodes make 1
    assert delta("iteration_tokens_total_count") == n_req * out
    assert delta("iteration_tokens_total_sum") == n_req * (prompt_len + out)


def test_metrics_engine_gauges_follow_running_requests(default_server, http):
    """§5 item 55: idle zeros; running and KV usage up during 3 long streams; zeros again
    after the clients go away."""

    def gauges() -> tuple[float, float, float]:
        m = metric_samples(http.get("/metrics").text)
        return (
            m["zserve:num_requests_running"],
            m["zserve:num_requests_waiting"],
            m["zserve:kv_cache_usage_perc"],
        )

    wait_for(lambda: gauges() == (0, 0, 0), what="idle gauges")
    lines = []
    with httpx.Client(base_url=default_server.base_url, timeout=60) as c, ExitStack() as streams:
        for i in range(3):
            body = {"prompt": [60 + i] * 40, "max_tokens": 900, "ignore_eos": True, "stream": True}
            r = streams.enter_context(c.stream("POST", "/v1/completions", json=body))
            lines.append(r.iter_lines())  # dropping the iterator would close the stream
            next(lines[-1])
        wait_for(lambda: gauges()[0] == 3 and gauges()[2] > 0, what="3 running requests")
    wait_for(lambda: gauges() == (0, 0, 0), what="gauges back to zero after the disconnects")


def test_responses_and_each_streams_last_chunk_carry_the_system_fingerprint(http):
    """--fingerprint-mode full (the default), where vLLM puts it: every whole response,
    a stream's finishing chunks, or its usage chunk when one ends the stream."""
    fingerprint = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()[
        "system_fingerprint"
    ]
    assert re.fullmatch(r"zserve-[0-9.]+-[0-9a-f]{8}", fingerprint), fingerprint
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert http.post("/v1/chat/completions", json=chat).json()["system_fingerprint"] == fingerprint
    _, sse = post_stream(http, "/v1/chat/completions", chat)
    marked = [e for e in sse.events if "system_fingerprint" in e]
    assert marked == [sse.events[-1]] and sse.events[-1]["choices"][0]["finish_reason"]
    assert marked[0]["system_fingerprint"] == fingerprint
    body = {"prompt": "x", "max_tokens": 3, "n": 2, "stream_options": {"include_usage": True}}
    _, sse = post_stream(http, "/v1/completions", body)
    marked = [e for e in sse.events if "system_fingerprint" in e]
    assert marked == [sse.events[-1]] and sse.events[-1]["choices"] == []
    _, sse = post_stream(http, "/v1/completions", {**body, "stream_options": None})
    finishing = [e for e in sse.events if e["choices"][0]["finish_reason"]]
    assert len(finishing) == 2
    assert all(e.get("system_fingerprint") == fingerprint for e in finishing)
    assert sum("system_fingerprint" in e for e in sse.events) == 2
