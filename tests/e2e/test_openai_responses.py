"""POST /v1/responses through the official openai client and raw HTTP, on the tools
server (tiny random llama, --tool-call-parser hermes; e2e/conftest.py): text, streams
and their events, function calls (forced by tool_choice, or written by the model under a
regex and parsed), multi-turn items, structured text, and every refusal."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from e2e_http import HERMES, MODEL, WEATHER_PARAMETERS, assert_error, named_events

pytestmark = pytest.mark.timeout(240)

RESPONSES = "/v1/responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
}


def events(http, body: dict) -> list[tuple[str, dict]]:
    """A stream's (event type, payload) pairs, numbered in order."""
    payloads = named_events(http, RESPONSES, body)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    return [(p["type"], p) for p in payloads]


def test_text_in_text_out_through_the_sdk(tools_client):
    r = tools_client.responses.create(
        model=MODEL, input="Weather?", instructions="Be brief.", max_output_tokens=6
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and r.output_text == message.content[0].text
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.instructions == "Be brief."
    # The instructions are a system message first: the prompt is longer with them.
    bare = tools_client.responses.create(model=MODEL, input="Weather?", max_output_tokens=6)
    assert bare.usage.input_tokens < r.usage.input_tokens


def test_a_stream_sends_openais_events_and_rebuilds_the_response(tools_http):
    body = {
        "model": MODEL,
        "input": "Weather?",
        "max_output_tokens": 8,
        "seed": 5,
        "top_logprobs": 2,
    }
    full = tools_http.post(RESPONSES, json=body).json()
    stream = events(tools_http, body)
    kinds = [k for k, _ in stream]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert stream[0][1]["response"]["status"] == "in_progress"
    deltas = [p for k, p in stream if k == "response.output_text.delta"]
    text = "".join(p["delta"] for p in deltas)
    final = stream[-1][1]["response"]
    assert (
        text == full["output"][0]["content"][0]["text"] == final["output"][0]["content"][0]["text"]
    )
    assert sum(len(p["logprobs"]) for p in deltas) == 8  # one entry per token
    assert all(len(e["top_logprobs"]) == 2 for p in deltas for e in p["logprobs"])
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 8


def test_the_sdks_stream_helper_gets_the_final_response(tools_client):
    with tools_client.responses.stream(model=MODEL, input="hi", max_output_tokens=4) as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" in seen and final.usage.output_tokens == 4


def check_call(item) -> None:
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": {"type": "function", "name": "get_weather"}},
        {"tool_choice": "auto", "structured_outputs": {"regex": HERMES}},
    ],
    ids=["named", "auto"],
)
def test_function_calls_come_as_items_whole_and_streamed(tools_client, tools_http, fields):
    kwargs = dict(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=150)
    r = tools_client.responses.create(**kwargs, extra_body={**fields, "seed": 1})
    assert r.status == "completed"
    (call,) = [item for item in r.output if item.type == "function_call"]
    check_call(call)
    stream = events(tools_http, {**kwargs, **fields, "seed": 1})
    added = [p["item"] for k, p in stream if k == "response.output_item.added"]
    assert added[-1]["type"] == "function_call" and added[-1]["name"] == "get_weather"
    arguments = "".join(
        p["delta"] for k, p in stream if k == "response.function_call_arguments.delta"
    )
    (done,) = [p for k, p in stream if k == "response.function_call_arguments.done"]
    assert arguments == done["arguments"] == call.arguments
    final = stream[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == [i.type for i in r.output]


def test_a_conversation_with_a_call_and_its_output_renders(tools_client):
    """function_call and function_call_output items become the assistant's tool call and
    the tool's answer in the chat template; the answer's text counts in the prompt."""
    turns = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "oslo", "unit": "C"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
    ]  # fmt: skip
    short = tools_client.responses.create(
        model=MODEL, input=turns, tools=[WEATHER], max_output_tokens=2
    )
    turns[-1] = {**turns[-1], "output": "cold and windy all week long"}
    long = tools_client.responses.create(
        model=MODEL, input=turns, tools=[WEATHER], max_output_tokens=2
    )
    assert long.usage.input_tokens > short.usage.input_tokens
    assert short.output[0].type == "message"


def test_text_format_json_schema_constrains_the_output(tools_client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "count", "schema": schema, "strict": True}}
    r = tools_client.responses.create(
        model=MODEL, input="A number?", text=fmt, max_output_tokens=40, extra_body={"seed": 2}
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", ["stores no responses"]),
        ({"background": True}, "background", ["not supported"]),
        ({"truncation": "auto"}, "truncation", ["never drops input items"]),
        ({"n": 2}, "n", ["one answer"]),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", ["function tools only"]),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice", ["auto"]),
        ({"input": []}, "input", ["at least one item"]),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", ["robot"]),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", ["item_reference"]),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            ["only text parts", "input_image"],
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", []),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", []),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", ["json_schema"]),
        ({"max_output_tokens": 0}, "max_output_tokens", []),
        ({"max_output_tokens": 10**6}, "max_output_tokens", ["max_model_len"]),
        ({"input": [{"role": "user", "content": "x"}] * 1025}, "input", ["--max-chat-messages"]),
        ({"input": 5}, "body.input", []),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", ["at most 16 pairs"]),
        ({"metadata": {"k": "v" * 513}}, "metadata", ["values 512"]),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(tools_http, fields, param, words):
    body = {"model": MODEL, "input": "x", **fields}
    assert_error(tools_http.post(RESPONSES, json=body), 400, param, words)
    assert tools_http.get("/health").status_code == 200


def test_nothing_is_stored_so_retrieving_is_a_404(tools_client, tools_http):
    r = tools_client.responses.create(model=MODEL, input="x", max_output_tokens=1, store=True)
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        tools_client.responses.retrieve(r.id)
    cancel = tools_http.post(f"{RESPONSES}/{'r' * 5000}/cancel")
    assert cancel.status_code == 404 and len(cancel.content) < 1000


def test_a_free_form_field_past_64_bit_integers_is_echoed_whole(tools_http):
    """The response echoes `reasoning` as sent: an integer orjson cannot encode goes out
    through the standard library's encoder, whole and streamed (the fuzz test found a 500)."""
    huge = -(2**63) - 1
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "reasoning": {"x": huge}}
    r = tools_http.post(RESPONSES, json=body)
    assert r.status_code == 200, r.text
    assert json.loads(r.text)["reasoning"] == {"x": huge}
    streamed = tools_http.post(RESPONSES, json={**body, "stream": True})
    assert streamed.status_code == 200
    echoes = [
        json.loads(line[len("data: ") :])["response"]["reasoning"]
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and '"response":' in line
    ]
    assert echoes and all(e == {"x": huge} for e in echoes), echoes
    assert "event: response.completed" in streamed.text and "event: error" not in streamed.text
