"""Issue 4, item 4: vLLM's sampling fields, stream_options, usage, request ids and
priority headers on default flags. The flag-dependent halves (--max-logprobs,
--enable-prompt-tokens-details, --enable-request-id-headers, generation_config
defaults, priority scheduling) are in test_openai_flags.py / test_openai_transport.py."""

from __future__ import annotations

import re

import pytest
from e2e_http import EOS, IM_START, MODEL, VOCAB_SIZE, assert_error, post_stream

pytestmark = pytest.mark.timeout(120)

A, B = ord("A"), ord("B")


def complete(client, **kwargs):
    extra = kwargs.pop("extra_body", {})
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("prompt", "abc")
    return client.completions.create(model=MODEL, extra_body=extra, **kwargs)


def text_of(client, **kwargs) -> str:
    return complete(client, **kwargs).choices[0].text


# --- the sampling fields reach the sampler ---------------------------------------------


def test_temperature_zero_is_deterministic(client):
    kwargs = dict(temperature=0, extra_body={"ignore_eos": True})
    assert text_of(client, **kwargs) == text_of(client, **kwargs)


def test_a_seed_reproduces_a_random_sample(client):
    kwargs = dict(temperature=1.0, max_tokens=16, extra_body={"ignore_eos": True})
    assert text_of(client, seed=1, **kwargs) == text_of(client, seed=1, **kwargs)
    assert len({text_of(client, seed=s, **kwargs) for s in (1, 2, 3)}) > 1


@pytest.mark.parametrize(
    "truncation",
    [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}],
    ids=["top_k", "top_p", "min_p"],
)
def test_truncation_to_the_best_token_equals_greedy(client, truncation):
    greedy = text_of(client, temperature=0, extra_body={"ignore_eos": True})
    kwargs = {"temperature": 1.0, "seed": 9}
    if "top_p" in truncation:
        kwargs["top_p"] = truncation["top_p"]
        extra = {}
    else:
        extra = truncation
    assert text_of(client, extra_body={"ignore_eos": True, **extra}, **kwargs) == greedy


def test_logit_bias_and_allowed_token_ids_constrain_the_tokens(client):
    assert text_of(client, temperature=1.0, logit_bias={str(A): 100}) == "A" * 12
    allowed = text_of(client, temperature=1.0, extra_body={"allowed_token_ids": [A, B]})
    assert set(allowed) <= {"A", "B"} and len(allowed) == 12


def test_frequency_penalty_breaks_a_repetition(client):
    kwargs = dict(temperature=0, max_tokens=20, extra_body={"allowed_token_ids": [A, B]})
    assert set(text_of(client, frequency_penalty=2.0, **kwargs)) == {"A", "B"}


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 1.5}, {"repetition_penalty": 1.3}, {"frequency_penalty": -1.0}],
)
def test_penalties_are_accepted_and_deterministic(client, penalty):
    kwargs = dict(temperature=0, extra_body={"ignore_eos": True})
    if "repetition_penalty" in penalty:
        kwargs["extra_body"] = {**kwargs["extra_body"], **penalty}
    else:
        kwargs.update(penalty)
    assert text_of(client, **kwargs) == text_of(client, **kwargs)


def test_eos_stops_unless_ignore_eos(client):
    r = complete(client, logit_bias={str(EOS): 100})
    choice = r.choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"], choice.text) == (
        "stop",
        None,
        "",
    )
    assert r.usage.completion_tokens == 1
    r = complete(client, logit_bias={str(EOS): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


def test_stop_token_ids_and_min_tokens(client):
    """A is preferred and stops; min_tokens forbids stopping for the first 4 tokens."""
    base = dict(temperature=0, logit_bias={str(A): 50})
    extra = {"allowed_token_ids": [A, B], "stop_token_ids": [A]}
    r = complete(client, **base, extra_body=extra)
    c = r.choices[0]
    assert (c.finish_reason, c.model_extra["stop_reason"]) == ("stop", A)
    assert r.usage.completion_tokens == 1
    r = complete(client, **base, extra_body={**extra, "min_tokens": 4})
    c = r.choices[0]
    assert (c.finish_reason, c.model_extra["stop_reason"]) == ("stop", A)
    assert r.usage.completion_tokens == 5
    assert c.text == "BBBB"  # the stop token is not text, as in vLLM
    extra["include_stop_str_in_output"] = True
    assert text_of(client, **base, extra_body={**extra, "min_tokens": 2}) == "BBA"


def test_skip_special_tokens_controls_special_token_text(client):
    kwargs = dict(temperature=0, max_tokens=3, logit_bias={str(IM_START): 100})
    assert text_of(client, **kwargs) == ""
    shown = text_of(client, **kwargs, extra_body={"skip_special_tokens": False})
    assert shown == "<|im_start|>" * 3
    # EOS ends the text without showing up in it, whatever skip_special_tokens says.
    kwargs["logit_bias"] = {str(EOS): 100}
    assert text_of(client, **kwargs, extra_body={"skip_special_tokens": False}) == ""


def test_min_tokens_above_max_tokens_is_a_400(http):
    for path, body in [
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "u", "content": "x"}], "min_tokens": 5000}),
    ]:
        assert_error(http.post(path, json=body), 400, "min_tokens", ["min_tokens"])


def test_vocab_limits_on_logit_bias_and_stop_token_ids(http):
    """§5 item 40."""
    for field, value in [
        ("logit_bias", {str(VOCAB_SIZE + 1): 1}),
        ("stop_token_ids", [VOCAB_SIZE + 1]),
        ("allowed_token_ids", [VOCAB_SIZE]),
    ]:
        body = {"messages": [{"role": "user", "content": "x"}], field: value}
        assert_error(
            http.post("/v1/chat/completions", json=body),
            400,
            field,
            [str(VOCAB_SIZE), str(VOCAB_SIZE + (field != "allowed_token_ids"))],
        )
    ok = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "logit_bias": {str(VOCAB_SIZE - 1): 1},
        "stop_token_ids": [VOCAB_SIZE - 1],
    }
    assert http.post("/v1/chat/completions", json=ok).status_code == 200


# --- stream_options and usage (§5 items 18-22, 35) ---------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options(http, path):
    body = {"max_tokens": 6, "ignore_eos": True, "temperature": 0}
    body |= (
        {"prompt": "abc"} if "chat" not in path else {"messages": [{"role": "u", "content": "x"}]}
    )

    def usage_of(events):
        return [e.get("usage") for e in events]

    for opts in (
        None,
        {},
        {"include_usage": False},
        {"include_usage": False, "continuous_usage_stats": True},
    ):
        extra = {} if opts is None else {"stream_options": opts}
        _, sse = post_stream(http, path, body | extra)
        assert sse.done and all(u is None for u in usage_of(sse.events)), opts

    _, sse = post_stream(http, path, body | {"stream_options": {"include_usage": True}})
    *content, last = sse.events
    assert all(u is None for u in usage_of(content))
    assert last["choices"] == []
    u = last["usage"]
    assert u["completion_tokens"] == 6 and u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]

    opts = {"include_usage": True, "continuous_usage_stats": True}
    _, sse = post_stream(http, path, body | {"stream_options": opts, "min_tokens": 6})
    *content, last = sse.events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    counts = [e["usage"]["completion_tokens"] for e in content]
    assert counts == sorted(counts) and counts[-1] == 6
    for e in sse.events:
        u = e["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_a_400(http, path):
    body = {"prompt": "x"} if "chat" not in path else {"messages": [{"role": "u", "content": "x"}]}
    r = http.post(path, json=body | {"stream_options": {"include_usage": True}})
    assert_error(r, 400, "stream_options")


def test_usage_has_no_prompt_tokens_details_by_default(client):
    for _ in range(2):  # the second one hits the prefix cache
        r = complete(client, prompt="x" * 40, max_tokens=1)
    assert r.usage.prompt_tokens_details is None


# --- request ids and priority headers ---------------------------------------------------


def test_request_id_comes_from_the_header_then_the_body_then_random(http):
    body = {"prompt": "x", "max_tokens": 1}
    r = http.post("/v1/completions", json=body | {"request_id": "from-body"})
    assert r.json()["id"] == "cmpl-from-body"
    r = http.post(
        "/v1/completions",
        json=body | {"request_id": "from-body"},
        headers={"X-Request-Id": "from-header"},
    )
    assert r.json()["id"] == "cmpl-from-header"
    assert "x-request-id" not in r.headers  # echoed only with --enable-request-id-headers
    ids = {http.post("/v1/completions", json=body).json()["id"] for _ in range(2)}
    assert len(ids) == 2 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "u", "content": "x"}], "max_tokens": 1},
        headers={"X-Request-Id": "abc"},
    )
    assert chat.json()["id"] == "chatcmpl-abc"


def test_two_clients_may_send_the_same_request_id(client):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda _: complete(
                    client,
                    max_tokens=20,
                    extra_body={"ignore_eos": True, "request_id": "same"},
                ),
                range(4),
            )
        )
    assert all(r.usage.completion_tokens == 20 for r in results)


def test_priority_headers_win_over_the_body(http):
    body = {"prompt": "x", "max_tokens": 1}
    assert_error(http.post("/v1/completions", json=body | {"priority": 5}), 400, "priority")
    r = http.post("/v1/completions", json=body | {"priority": 5}, headers={"X-Priority": "0"})
    assert r.status_code == 200
    r = http.post("/v1/completions", json=body, headers={"X-Vllm-Priority": "3"})
    assert_error(r, 400, "priority", ["--scheduling-policy priority"])
    r = http.post("/v1/completions", json=body, headers={"X-Priority": "high"})
    assert_error(r, 400, "x-priority")
