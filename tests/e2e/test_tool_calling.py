"""Issue 17: tool calling through the official openai client and raw HTTP, on the tiny
random-weight llama with `--enable-auto-tool-choice --tool-call-parser hermes`.

`required` and named choices are enforced by structured outputs, so even random weights
return valid, schema-conforming calls; `auto` parses what the model writes (forced here
into the Hermes format with a regex constraint)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from e2e_http import HERMES, MODEL, SMALL_KV, WEATHER_PARAMETERS, assert_error, post_stream
from transformers import PreTrainedTokenizerFast
from zserve_proc import ZServe

from frontend.tool_parsers.messages import template_messages

pytestmark = pytest.mark.timeout(240)

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Weather?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_time"}}
# A random model closes a `required` list of calls late: make "]" likely once allowed.
CLOSE_LIST = {str(ord("]")): 3.0}


def check_calls(calls: list[dict], at_most: int | None = None) -> None:
    assert calls and (at_most is None or len(calls) <= at_most), calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_"), call
        function = call["function"]
        jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])


def chat(http, **fields) -> dict:
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 150, "logit_bias": CLOSE_LIST, **fields}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_required_returns_calls_that_follow_the_tools_schemas(tools_http):
    for seed in range(3):
        for c in chat(tools_http, tool_choice="required", n=2, seed=seed)["choices"]:
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
            check_calls(c["message"]["tool_calls"])


def test_required_without_parallel_calls_makes_exactly_one(tools_http):
    for seed in range(3):
        body = chat(tools_http, tool_choice="required", parallel_tool_calls=False, seed=seed)
        c = body["choices"][0]
        check_calls(c["message"]["tool_calls"], at_most=1)


def test_a_named_function_is_called_with_valid_arguments(tools_client):
    for seed in range(3):
        r = tools_client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=60, seed=seed
        )
        c = r.choices[0]
        # A named choice keeps finish_reason "stop", as OpenAI and vLLM report it.
        assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])


def test_auto_parses_the_calls_the_model_writes(tools_http):
    c = chat(tools_http, guided_regex=HERMES, seed=1)["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    check_calls(c["message"]["tool_calls"])
    plain = chat(tools_http, guided_regex="[a-z]{3,8}", seed=1)["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["tool_calls"] == []
    assert plain["message"]["content"].isalpha()


def reassemble(events: list[dict]) -> tuple[list[dict], str, str | None]:
    """Streamed tool-call deltas → calls; the content; the finish reason."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            finish = choice["finish_reason"] or finish
            for piece in delta.get("tool_calls") or []:
                if piece["index"] not in calls:  # the first piece: id, type and name
                    assert piece["id"].startswith("call_") and piece["type"] == "function"
                    assert piece["function"]["name"], piece
                    calls[piece["index"]] = {
                        "id": piece["id"],
                        "type": "function",
                        "function": {"name": piece["function"]["name"], "arguments": ""},
                    }
                else:
                    assert "id" not in piece and "name" not in piece["function"], piece
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], content, finish


@pytest.mark.parametrize(
    "fields",
    [{"tool_choice": "required"}, {"tool_choice": NAMED}, {"guided_regex": HERMES}],
    ids=["required", "named", "auto"],
)
def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_result(tools_http, fields):
    for seed in range(2):
        full = chat(tools_http, seed=seed, **fields)["choices"][0]
        body = {
            "messages": USER,
            "tools": TOOLS,
            "max_tokens": 150,
            "logit_bias": CLOSE_LIST,
            "seed": seed,
            **fields,
        }
        _, sse = post_stream(tools_http, CHAT, body)
        calls, content, finish = reassemble(sse.events)
        strip = [{k: v for k, v in c.items() if k != "id"} for c in calls]
        expected = [
            {k: v for k, v in c.items() if k != "id"} for c in full["message"]["tool_calls"]
        ]
        assert strip == expected and (content or None) == full["message"]["content"]
        assert finish == full["finish_reason"]


def test_tool_choice_none_leaves_the_output_as_content(tools_http):
    c = chat(tools_http, tool_choice="none", guided_regex=HERMES, seed=2)["choices"][0]
    assert c["finish_reason"] == "stop" and c["message"]["tool_calls"] == []
    assert c["message"]["content"].startswith("<tool_call>")


def test_a_multi_turn_tool_history_renders_through_the_template(tools_http, tiny_model):
    one = {"tools": [TIME], "tool_choice": "required", "max_tokens": 60}
    first = chat(tools_http, parallel_tool_calls=False, seed=4, **one)
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "noon"},
    ]
    second = chat(tools_http, messages=history, parallel_tool_calls=False, seed=5, **one)
    check_calls(second["choices"][0]["message"]["tool_calls"], at_most=1)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model("llama"))
    messages = template_messages([{**m, "content": m["content"] or ""} for m in history])
    prompt = tokenizer.apply_chat_template(
        messages, tools=[TIME], add_generation_prompt=True, tokenize=False
    )
    assert "<tool_response>\nnoon\n</tool_response>" in prompt
    assert json.dumps(json.loads(call["function"]["arguments"])) in prompt
    assert second["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))


BAD = [
    ({"tools": {"f": 1}}, "body.tools", ["list"]),  # the request model: vLLM's body.<field>
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", ["twice"]),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", []),
    ({"tools": [WEATHER] * 129}, "tools", ["128"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "x" * 70000}}}]}, "tools[0].function.parameters", ["bytes"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", ["nope"]),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ["required"]),
    ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", ["response_format"]),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", ["guided_regex"]),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}, "messages[0].tool_calls[0].function.arguments", ["JSON"]),
    ({"messages": [{"role": "tool", "tool_call_id": 5, "content": "x"}]}, "messages[0].tool_call_id", []),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD, ids=[b[1] for b in BAD])
def test_bad_tool_requests_are_a_400_naming_the_field(tools_http, fields, param, words):
    body = {"messages": USER, "max_tokens": 5, **fields}
    assert_error(tools_http.post(CHAT, json=body), 400, param, words)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tool-call-parser", "nope"], ["--tool-call-parser", "'nope'", "hermes"]),
        (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice needs --tool-call-parser"]),
        (["--reasoning-parser", "nope"], ["--reasoning-parser", "deepseek_r1"]),
        (["--tool-parser-plugin", "/no/such.py"], ["--tool-parser-plugin", "not a file"]),
        (["--structured-outputs-config", "backend=guidance"], ["not available", "xgrammar"]),
        (["--structured-outputs-config", "speed=9"], ["unknown key 'speed'"]),
    ],
)
def test_bad_tool_and_structured_output_flags_stop_the_start_with_a_clear_message(
    tiny_model, flags, words
):
    with ZServe(str(tiny_model("llama")), *SMALL_KV, *flags, wait_ready=False) as server:
        assert server.proc.wait(timeout=60) == 2
        log = server.log()
    assert all(w in log for w in words), log[-2000:]
    assert "Traceback" not in log, log[-2000:]
