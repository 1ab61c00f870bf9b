"""POST /v1/messages and /v1/messages/count_tokens through Anthropic's official client
and raw HTTP, on the tools server (tiny random llama, --tool-call-parser hermes;
e2e/conftest.py): text, streams and their events, tool use (forced by tool_choice, or
written by the model under a regex and parsed), a tool round trip, stop sequences,
token counts, Anthropic-shaped errors, and x-api-key."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from e2e_http import EOS, HERMES, MODEL, WEATHER_PARAMETERS, named_events

pytestmark = pytest.mark.timeout(240)

MESSAGES = "/v1/messages"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER_PARAMETERS,
}
USER = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def claude(tools_server):
    with anthropic.Anthropic(
        base_url=tools_server.base_url, api_key="none", max_retries=0, timeout=120
    ) as c:
        yield c


def events(http, body: dict) -> list[dict]:
    return named_events(http, MESSAGES, body)


def test_text_through_the_sdk(claude):
    m = claude.messages.create(model=MODEL, max_tokens=6, system="Be brief.", messages=USER)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_") and m.stop_reason == "max_tokens"
    (block,) = m.content
    assert block.type == "text" and block.text
    assert m.usage.output_tokens == 6
    bare = claude.messages.create(model=MODEL, max_tokens=6, messages=USER)
    assert bare.usage.input_tokens < m.usage.input_tokens  # the system prompt counted
    count = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=USER)
    assert count.input_tokens == m.usage.input_tokens


def test_a_stream_sends_anthropics_events_and_the_sdk_rebuilds_the_message(claude, tools_http):
    body = {"model": MODEL, "max_tokens": 8, "messages": USER, "seed": 3}
    whole = tools_http.post(MESSAGES, json=body).json()
    stream = events(tools_http, body)
    kinds = [e["type"] for e in stream]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for e in stream if e["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert stream[-2]["delta"]["stop_reason"] == "max_tokens"
    assert stream[-2]["usage"]["output_tokens"] == 8
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=USER, extra_body={"seed": 3}
    ) as s:
        final = s.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"


def check_use(block) -> None:
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("call_")
    jsonschema.validate(block.input, WEATHER["input_schema"])


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": {"type": "tool", "name": "get_weather"}},
        {"tool_choice": {"type": "auto"}, "structured_outputs": {"regex": HERMES}},
    ],
    ids=["named", "auto"],
)
def test_tool_use_blocks_whole_and_streamed(claude, tools_http, extra):
    body = {"model": MODEL, "max_tokens": 150, "messages": USER, "tools": [WEATHER], "seed": 1}
    m = claude.messages.create(
        model=MODEL,
        max_tokens=150,
        messages=USER,
        tools=[WEATHER],
        tool_choice=extra["tool_choice"],
        extra_body={k: v for k, v in {**extra, "seed": 1}.items() if k != "tool_choice"},
    )
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    check_use(use)
    stream = events(tools_http, {**body, **extra})
    starts = [e["content_block"] for e in stream if e["type"] == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    partial = "".join(
        e["delta"]["partial_json"]
        for e in stream
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(partial) == use.input
    assert stream[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_tool_round_trip_renders_the_result(claude):
    """The assistant's tool_use and the user's tool_result become the chat template's
    call and tool message: a longer result makes a longer prompt."""

    def conversation(result: str) -> list[dict]:
        return [
            *USER,
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "tool_use", "id": "call_1", "name": "get_weather",
                 "input": {"city": "oslo", "unit": "C"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1",
                 "content": [{"type": "text", "text": result}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ]  # fmt: skip

    short = claude.messages.count_tokens(
        model=MODEL, messages=conversation("cold"), tools=[WEATHER]
    )
    long = claude.messages.count_tokens(
        model=MODEL, messages=conversation("cold and windy all week"), tools=[WEATHER]
    )
    assert long.input_tokens > short.input_tokens
    m = claude.messages.create(
        model=MODEL, max_tokens=3, messages=conversation("cold"), tools=[WEATHER]
    )
    assert m.usage.input_tokens == short.input_tokens


def test_a_stop_sequence_is_reported(claude):
    """EOS is forbidden and the model's likeliest text is forced by a regex ending in
    "zz": the stop sequence "zz" ends it, and Anthropic's client sees which."""
    m = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=USER,
        stop_sequences=["zz"],
        extra_body={"structured_outputs": {"regex": "ab zz cd"}, "logit_bias": {str(EOS): -100}},
    )
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "zz")
    assert m.content[0].text == "ab "


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"max_tokens": None}, ["max_tokens"]),
        ({"messages": [{"role": "system", "content": "x"}]}, ["messages[0].role"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            ["'image'"],
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "w"}]}, ["client tools only"]),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, ["tool_choice"]),
        ({"messages": USER * 1025}, ["--max-chat-messages"]),
        ({"n": 2}, ["one answer"]),
        ({"stop_sequences": ["x"] * 10_000}, ["stop_sequences has 10000", "--max-stop-strings"]),
        ({"stop_sequences": ["x" * 100_000]}, ["--max-stop-string-length"]),
    ],
)
def test_errors_have_anthropics_shape(tools_http, fields, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": USER, **fields}
    r = tools_http.post(MESSAGES, json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert all(w in error["error"]["message"] for w in words), error
    assert tools_http.get("/health").status_code == 200


def test_the_sdk_raises_its_own_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=10**6, messages=USER)
    assert "max_model_len" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus", max_tokens=2, messages=USER)
