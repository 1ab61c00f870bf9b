"""vLLM's scale-out routes on the default server (--enable-scale-out): a chat, completion,
Messages or Responses request rendered into token ids and engine parameters, then run
by POST /inference/v1/generate exactly as the route itself runs it; generate's own
answer (tokens or text, logprobs by id, streams), its refusals by field, and the 403
of a server without the flag. The abort of requests across API servers and engines is
in test_dev_routes.py (a two-API-server, two-node deployment)."""

from __future__ import annotations

import pytest
from e2e_http import EOS, MODEL, assert_error, post_stream

pytestmark = pytest.mark.timeout(120)

GENERATE = "/inference/v1/generate"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}
PROMPT = [1, 72, 80, 101]
ONE_TOKEN = {"request_id": "g", "choices": [{"index": 0, "token_ids": [72]}]}


def generate(http, body: dict) -> dict:
    r = http.post(GENERATE, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def render(http, path: str, body: dict):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
def test_a_rendered_chat_request_runs_as_the_chat_route_runs_it(http, sampling):
    body = {**CHAT, "max_tokens": 7, **sampling}
    direct = http.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()
    rendered = render(http, "/v1/chat/completions/render", body)
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == MODEL
    assert rendered["token_ids"] == direct["prompt_token_ids"]
    params = rendered["sampling_params"]
    assert params["max_tokens"] == 7 and params["output_kind"] == 2  # vLLM's FINAL_ONLY
    assert params["temperature"] == sampling["temperature"]
    tokens = generate(http, rendered)
    assert tokens["request_id"] == "generate-tokens-" + rendered["request_id"]
    assert tokens["output_mode"] == "tokens" and "text" not in tokens["choices"][0]
    assert tokens["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert tokens["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    text = generate(http, {**rendered, "output_mode": "text"})
    assert text["choices"][0]["text"] == direct["choices"][0]["message"]["content"]


def test_a_rendered_completion_is_one_generate_request_per_prompt(http):
    body = {"model": MODEL, "prompt": ["hello", "world x"], "max_tokens": 5, "temperature": 0}
    direct = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    rendered = render(http, "/v1/completions/render", body)
    assert [r["request_id"][-2:] for r in rendered] == ["-0", "-1"]
    for i, request in enumerate(rendered):
        assert request["token_ids"] == direct["choices"][i]["prompt_token_ids"]
        out = generate(http, request)
        assert out["choices"][0]["token_ids"] == direct["choices"][i]["token_ids"]


def test_messages_and_responses_render_the_conversation_chat_renders(http):
    chat = render(http, "/v1/chat/completions/render", {**CHAT, "max_tokens": 9})
    messages = render(http, "/v1/messages/render", {**CHAT, "max_tokens": 9})
    responses = render(
        http,
        "/v1/responses/render",
        {"model": MODEL, "input": "Hello there", "max_output_tokens": 9},
    )
    assert responses["request_id"].startswith("resp_")
    for other in (messages, responses):
        assert other["token_ids"] == chat["token_ids"]
        assert other["sampling_params"]["max_tokens"] == 9


def test_constraints_are_rendered_and_kept_by_generate(http):
    body = {**CHAT, "max_tokens": 6, "structured_outputs": {"choice": ["yes", "no"]}}
    rendered = render(http, "/v1/chat/completions/render", body)
    assert rendered["sampling_params"]["structured_outputs"] == {"choice": ["yes", "no"]}
    out = generate(http, {**rendered, "output_mode": "text"})
    assert out["choices"][0]["text"] in ("yes", "no")
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    forced = {
        **CHAT,
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    rendered = render(http, "/v1/chat/completions/render", forced)
    assert rendered["sampling_params"]["structured_outputs"] == {"json": parameters}


def test_a_stream_carries_what_the_whole_answer_does(http):
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 6, "logprobs": 2},
        "return_token_ids": True,
    }
    whole = generate(http, body)
    r, sse = post_stream(http, GENERATE, {**body, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and sse.done
    assert sse.events[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in e for e in sse.events[1:])
    assert sse.events[-1]["choices"] == [] and sse.events[-1]["usage"] == {
        k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    for choice in whole["choices"]:
        parts = [c for e in sse.events for c in e["choices"] if c["index"] == choice["index"]]
        assert [t for p in parts for t in p["token_ids"]] == choice["token_ids"]
        assert parts[-1]["finish_reason"] == choice["finish_reason"] == "length"
        entries = choice["logprobs"]["content"]
        streamed = [e for p in parts for e in p["logprobs"]["content"]]
        assert [e["token_id"] for e in streamed] == [e["token_id"] for e in entries]
        for token_id, entry in zip(choice["token_ids"], entries, strict=True):
            top = entry["top_logprobs"]
            assert entry["token_id"] == token_id == top[0]["token_id"]
            assert entry["rank"] == top[0]["rank"] >= 1 and len(top) == 2
            if entry["rank"] != 1:
                assert top[1]["rank"] == 1 and top[1]["logprob"] >= entry["logprob"]
    assert whole["prompt_token_ids"] == PROMPT


def test_text_mode_applies_stop_strings_and_names_tokens(http):
    free = generate(
        http,
        {
            "token_ids": PROMPT,
            "sampling_params": {"temperature": 0, "max_tokens": 12},
            "output_mode": "text",
        },
    )
    prompt_logprobs = generate(
        http, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}}
    )["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    for token_id, entry in zip(PROMPT[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in entry and 1 <= len(entry) <= 2
    assert free["prompt_logprobs"] is None
    text = free["choices"][0]["text"]
    stop = text[3:5]
    assert stop and stop not in text[:3]
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_tokens": 12, "stop": [stop], "logprobs": 0},
        "output_mode": "text",
    }
    out = generate(http, body)["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert out["text"] == text[: text.index(stop)]
    assert all(
        set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in out["logprobs"]["content"]
    )
    tokens = generate(http, {**body, "output_mode": "tokens"})["choices"][0]
    assert tokens["stop_reason"] == stop and tokens["token_ids"] == out["token_ids"]


def test_unset_max_tokens_means_the_rest_of_the_context(http):
    out = generate(http, {"token_ids": [1] * 1020, "sampling_params": {"ignore_eos": True}})
    assert out["usage"]["completion_tokens"] == 4
    assert out["choices"][0]["finish_reason"] == "length"
    rendered = render(http, "/v1/chat/completions/render", CHAT)
    assert rendered["sampling_params"]["max_tokens"] == 1024 - len(rendered["token_ids"])
    rendered = render(http, "/v1/completions/render", {"model": MODEL, "prompt": PROMPT})
    assert rendered[0]["sampling_params"]["max_tokens"] == 16  # completions' default


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"token_ids": [], "sampling_params": {}}, "body.token_ids", ["at least 1"]),
        ({"token_ids": [1, -2], "sampling_params": {}}, "body.token_ids", ["negative"]),
        ({"token_ids": [1, 99999], "sampling_params": {}}, "token_ids", ["out of vocabulary"]),
        ({"token_ids": [1]}, "body.sampling_params", ["required"]),
        ({"token_ids": [1] * 1024, "sampling_params": {}}, "input_tokens", ["1024"]),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 5000}}, "sampling_params.max_tokens", ["5000"]),
        ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature", []),
        ({"token_ids": [1], "sampling_params": {"n": 5000}}, "sampling_params.n", ["5000"]),
        ({"token_ids": [1], "sampling_params": {"logprobs": 99}}, "sampling_params.logprobs", ["--max-logprobs"]),
        ({"token_ids": [1], "sampling_params": {"stop": ["s" * 5000]}}, "sampling_params.stop", ["5000"]),
        ({"token_ids": [1], "sampling_params": {"stop": ["a"], "detokenize": False}}, "sampling_params.stop", ["detokenize"]),
        ({"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"}, "output_mode", ["detokenize"]),
        ({"token_ids": [1], "sampling_params": {"bad_words": ["a"]}}, "sampling_params.bad_words", []),
        ({"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "("}}}, "sampling_params.structured_outputs.regex", []),
        ({"token_ids": [1], "sampling_params": {}, "kv_transfer_params": {"a": 1}}, "kv_transfer_params", []),
        ({"token_ids": [1], "sampling_params": {}, "features": {"mm_hashes": {}}}, "features", []),
        ({"token_ids": [1], "sampling_params": {}, "output_mode": "bytes"}, "body.output_mode", []),
    ],
)  # fmt: skip
def test_generate_refuses_by_field(http, body, param, words):
    assert_error(http.post(GENERATE, json=body), 400, param, words)


def test_render_refuses_what_a_token_request_cannot_carry(http):
    assert_error(
        http.post("/v1/completions/render", json={"model": MODEL, "prompt": "a", "echo": True}),
        400,
        "echo",
    )
    body = {**CHAT, "use_beam_search": True, "n": 2, "max_tokens": 4}
    assert_error(http.post("/v1/chat/completions/render", json=body), 400, "use_beam_search")


def test_a_server_without_the_flag_answers_403(tools_http):
    for path in (GENERATE, "/v1/chat/completions/render", "/inference/v1/abort_requests"):
        error = assert_error(tools_http.post(path, json={}), 403, None, ["--enable-scale-out"])
        assert error["type"] == "PermissionDeniedError"


# --- derender: a generate response back into the route's response ----------------------


def test_render_generate_derender_answers_what_the_chat_route_answers(http):
    body = {**CHAT, "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": True}
    body["top_logprobs"] = 2
    direct = http.post("/v1/chat/completions", json=body).json()
    rendered = render(http, "/v1/chat/completions/render", body)
    generated = generate(http, rendered)
    derendered = render(
        http,
        "/v1/chat/completions/derender",
        {
            "generate_response": generated,
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": body,
        },
    )
    assert derendered["id"] == generated["request_id"]
    assert derendered["object"] == "chat.completion" and derendered["model"] == MODEL
    assert derendered["usage"] == direct["usage"]
    ours, theirs = derendered["choices"][0], direct["choices"][0]
    assert ours["message"] == theirs["message"]
    assert ours["finish_reason"] == theirs["finish_reason"]
    got, want = ours["logprobs"]["content"], theirs["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in want]
    assert [len(e["top_logprobs"]) for e in got] == [2] * len(want)
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-3)


def test_derender_cuts_at_the_stop_string_as_the_route_does(http):
    free = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12, "temperature": 0})
    text = free.json()["choices"][0]["message"]["content"]
    stop = text[4:6]
    assert stop and stop not in text[:4]
    body = {**CHAT, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    direct = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    rendered = render(http, "/v1/chat/completions/render", body)
    generated = generate(http, rendered)
    request = {"generate_response": generated, "chat_request": body}
    ours = render(http, "/v1/chat/completions/derender", request)["choices"][0]
    assert ours["message"]["content"] == direct["message"]["content"] == text[: text.index(stop)]
    assert ours["stop_reason"] == direct["stop_reason"] == stop
    kept = render(
        http,
        "/v1/chat/completions/derender",
        {**request, "chat_request": {**body, "include_stop_str_in_output": True}},
    )
    assert kept["choices"][0]["message"]["content"].endswith(stop)


def test_render_generate_derender_answers_what_the_completion_route_answers(http):
    body = {"model": MODEL, "prompt": ["hello", "world"], "max_tokens": 6, "logprobs": 1}
    body |= {"temperature": 0}
    direct = http.post("/v1/completions", json=body).json()
    responses = [generate(http, r) for r in render(http, "/v1/completions/render", body)]
    derendered = render(
        http,
        "/v1/completions/derender",
        {"generate_responses": responses, "completion_request": body},
    )
    assert derendered["object"] == "text_completion"
    assert derendered["usage"] == direct["usage"]
    for ours, theirs in zip(derendered["choices"], direct["choices"], strict=True):
        assert ours["text"] == theirs["text"] and ours["index"] == theirs["index"]
        assert ours["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]


def test_derender_drops_an_eos_and_keeps_every_other_last_token(http):
    """finish_reason stop without a stop string: the last token is no text when it is the
    EOS (or the stop token id named), whatever skip_special_tokens says."""

    def content(token_ids, chat_request=None, **fields):
        choice = {"index": 0, "token_ids": token_ids, "finish_reason": "stop", **fields}
        body = {"generate_response": {"request_id": "g", "choices": [choice]}}
        if chat_request is not None:
            body["chat_request"] = chat_request
        return render(http, "/v1/chat/completions/derender", body)["choices"][0]["message"]

    plain = content([72, 80])["content"]
    assert plain and content([72])["content"] != plain  # the last token was kept
    keep_special = {**CHAT, "skip_special_tokens": False}
    assert content([72, 80, EOS], keep_special)["content"] == plain
    assert content([72, 80, 101], stop_reason=101)["content"] == plain


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions/derender", {"stream": True, "generate_chunk": {}}, "stream"),
        ("/v1/chat/completions/derender", {}, "body.generate_response"),
        (
            "/v1/chat/completions/derender",
            {"generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": [1, 99999]}]}},
            "token_ids",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": [1] * 1025}]}},
            "token_ids",
        ),
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": [1]}]},
                "chat_request": {"messages": []},
            },
            "chat_request.messages",
        ),
        (
            "/v1/completions/derender",
            {
                "generate_responses": [
                    {"request_id": "g", "choices": [{"index": i, "token_ids": [1]} for i in range(1025)]}
                ]
            },
            "choices",
        ),
        ("/v1/completions/derender", {"generate_responses": []}, "body.generate_responses"),
        # A generate response answers one choice at least (a 500 before; the fuzz found it).
        ("/v1/chat/completions/derender", {"generate_response": {"request_id": "", "choices": []}},
         "body.generate_response.choices"),
        # Echoed counts stay 64-bit and plausible; the original request keeps its limits.
        (
            "/v1/chat/completions/derender",
            {"generate_response": {**ONE_TOKEN, "choices": [{"index": 0, "token_ids": [1], "stop_reason": 10**30}]}},
            "generate_response.choices.0.stop_reason",
        ),
        ("/v1/chat/completions/derender", {"generate_response": ONE_TOKEN, "prompt_tokens": 10**30}, "prompt_tokens"),
        ("/v1/completions/derender", {"generate_responses": [ONE_TOKEN], "prompt_tokens": [-5]}, "prompt_tokens"),
        (
            "/v1/chat/completions/derender",
            {"generate_response": {**ONE_TOKEN, "usage": {"prompt_tokens": "x"}}},
            "body.generate_response.usage.prompt_tokens",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": ONE_TOKEN, "chat_request": {**CHAT, "stop": ["s"] * 65}},
            "chat_request.stop",
        ),
        (
            "/v1/completions/derender",
            {"generate_responses": [ONE_TOKEN], "completion_request": {"prompt": "a", "stop": ["s" * 5000]}},
            "completion_request.stop",
        ),
    ],
)  # fmt: skip
def test_derender_refuses_by_field(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param)
