"""The request side of tool calling: validation with limits, forced-choice schemas and their
parsers, parser plugins, and tool-calling history rendered by a chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer, models
from tool_call_texts import assemble, hermes, stream
from transformers import PreTrainedTokenizerFast

from frontend.tool_parsers import (
    ToolParserError,
    get_tool_parser,
    load_tool_parser_plugin,
    registry,
)
from frontend.tool_parsers.forced import (
    chat_finish_reason,
    forced_tool_parser,
    named_tool_schema,
    required_tools_schema,
)
from frontend.tool_parsers.messages import template_messages
from frontend.tool_parsers.request import (
    ToolChoice,
    ToolRequestError,
    ToolRequestLimits,
    check_server_support,
    tools_for_template,
    validate_tool_choice,
    validate_tools,
)
from launcher.chat_templates import CHATML, CHATML_TOOLS


def tool(name, parameters=None, **extra):
    function = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool(
    "get_weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    description="Current weather",
)
TREE = tool(
    "add_node",
    {
        "type": "object",
        "properties": {"node": {"$ref": "#/$defs/Node"}},
        "required": ["node"],
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                },
                "required": ["label"],
                "additionalProperties": False,
            }
        },
    },
)
NO_PARAMS = tool("ping")


# --- validation --------------------------------------------------------------------------


def test_valid_tools_pass_and_are_normalized():
    tools = validate_tools([WEATHER, TREE, NO_PARAMS, {"function": {"name": "x-y_1"}}])
    assert [t["function"]["name"] for t in tools] == ["get_weather", "add_node", "ping", "x-y_1"]
    assert all(t["type"] == "function" for t in tools)
    assert validate_tools(None) == []


@pytest.mark.parametrize(
    "tools,param,words",
    [
        ("nope", "tools", "list"),
        ([{"type": "retrieval"}], "tools[0]", "function"),
        ([{"type": "function"}], "tools[0].function", "object"),
        ([tool("has space")], "tools[0].function.name", "64"),
        ([tool("x" * 65)], "tools[0].function.name", "64"),
        ([tool(5)], "tools[0].function.name", "letters"),
        ([WEATHER, WEATHER], "tools[1].function.name", "twice"),
        ([tool("f", [])], "tools[0].function.parameters", "schema"),
        ([tool("f", {"type": "array"})], "tools[0].function.parameters", "object"),
        ([tool("f", description=7)], "tools[0].function.description", "string"),
    ],
)
def test_bad_tools_name_the_field(tools, param, words):
    with pytest.raises(ToolRequestError) as e:
        validate_tools(tools)
    assert e.value.param == param
    assert words in e.value.message and e.value.message.startswith(param)


def test_tool_limits_are_enforced():
    limits = ToolRequestLimits(
        max_tools=2, max_parameters_bytes=200, max_schema_depth=5, max_description_chars=10
    )
    cases = [
        ([tool("a"), tool("b"), tool("c")], "tools", "at most 2"),
        (
            [tool("a", {"type": "object", "description": "x" * 300})],
            "tools[0].function.parameters",
            "200 bytes",
        ),
        (
            [tool("a", {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}})],
            "tools[0].function.parameters",
            "deeper",
        ),
        ([tool("a", description="x" * 11)], "tools[0].function.description", "10"),
    ]
    for tools, param, words in cases:
        with pytest.raises(ToolRequestError) as e:
            validate_tools(tools, limits)
        assert e.value.param == param and words in e.value.message


def test_a_hostile_deep_schema_is_refused_without_recursion():
    deep: dict = {}
    node = deep
    for _ in range(100_000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ToolRequestError, match="deeper"):
        validate_tools([tool("f", deep)])


def test_tool_choice_values():
    tools = validate_tools([WEATHER])
    assert validate_tool_choice(None, tools) == ToolChoice("auto")
    assert validate_tool_choice(None, []) == ToolChoice("none")
    assert validate_tool_choice("none", []) == ToolChoice("none")
    assert validate_tool_choice("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert validate_tool_choice(named, tools) == ToolChoice("named", "get_weather")


@pytest.mark.parametrize(
    "choice,tools,param,words",
    [
        ("auto", [], "tool_choice", "tools"),
        ("required", [], "tool_choice", "tools"),
        ("sometimes", [WEATHER], "tool_choice", "must be"),
        ({"type": "function"}, [WEATHER], "tool_choice.function", "object"),
        ({"function": {"name": "get_weather"}}, [WEATHER], "tool_choice", "named"),
        (
            {"type": "function", "function": {"name": "nope"}},
            [WEATHER],
            "tool_choice.function.name",
            "not one of",
        ),
        (5, [WEATHER], "tool_choice", "named"),
    ],
)
def test_bad_tool_choice_names_the_field(choice, tools, param, words):
    with pytest.raises(ToolRequestError) as e:
        validate_tool_choice(choice, validate_tools(tools))
    assert e.value.param == param and words in e.value.message


def test_auto_needs_the_server_flags_and_forced_choices_do_not():
    with pytest.raises(ToolRequestError, match="--enable-auto-tool-choice"):
        check_server_support(ToolChoice("auto"), auto_tool_choice=False, tool_parser="hermes")
    with pytest.raises(ToolRequestError, match="--tool-call-parser"):
        check_server_support(ToolChoice("auto"), auto_tool_choice=True, tool_parser=None)
    check_server_support(ToolChoice("auto"), auto_tool_choice=True, tool_parser="hermes")
    check_server_support(ToolChoice("required"), auto_tool_choice=False, tool_parser=None)
    check_server_support(ToolChoice("named", "f"), auto_tool_choice=False, tool_parser=None)


def test_tools_reach_the_template_unless_excluded_for_none():
    tools = validate_tools([WEATHER])
    assert tools_for_template(tools, ToolChoice("none"), exclude_when_none=False) == tools
    assert tools_for_template(tools, ToolChoice("none"), exclude_when_none=True) is None
    assert tools_for_template(tools, ToolChoice("auto"), exclude_when_none=True) == tools


# --- forced choices: schemas and the parsers of what they constrain -------------------------


def test_required_schema_accepts_calls_of_the_tools_and_nothing_else():
    tools = validate_tools([WEATHER, TREE, NO_PARAMS])
    schema = required_tools_schema(tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "add_node", "parameters": {"node": {"label": "a", "children": [{"label": "b"}]}}},
        {"name": "ping", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    bad = [
        [],
        [{"name": "unknown", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],  # required city missing
        [{"name": "get_weather"}],
        [{"name": "add_node", "parameters": {"node": {"label": "a", "children": [{"x": 1}]}}}],
        [{"name": "ping", "parameters": {}, "extra": 1}],
    ]
    for sample in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(sample, schema)


def test_required_schema_keeps_a_tools_references_to_its_own_root():
    node = tool(
        "node",
        {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#"}},
            },
            "required": ["v"],
        },
    )
    legacy = tool(
        "legacy",
        {
            "type": "object",
            "properties": {"a": {"$ref": "#/definitions/A"}},
            "definitions": {"A": {"type": "string"}},
        },
    )
    schema = required_tools_schema(validate_tools([node, legacy]))
    jsonschema.validate(
        [
            {"name": "node", "parameters": {"v": 1, "kids": [{"v": 2}]}},
            {"name": "legacy", "parameters": {"a": "x"}},
        ],
        schema,
    )
    for bad in (
        {"name": "node", "parameters": {"v": 1, "kids": [{}]}},
        {"name": "legacy", "parameters": {"a": 1}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)


def test_required_schema_with_parallel_calls_off_allows_one_call():
    schema = required_tools_schema(validate_tools([WEATHER]), parallel_tool_calls=False)
    call = {"name": "get_weather", "parameters": {"city": "Paris"}}
    jsonschema.validate([call], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], schema)


def test_named_schema_is_the_tools_arguments():
    tools = validate_tools([WEATHER, TREE, NO_PARAMS])
    jsonschema.validate({"city": "Paris"}, named_tool_schema(tools, "get_weather"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, named_tool_schema(tools, "get_weather"))
    jsonschema.validate({"node": {"label": "x"}}, named_tool_schema(tools, "add_node"))
    assert named_tool_schema(tools, "ping") == {"type": "object", "properties": {}}


def test_required_output_becomes_tool_calls_streamed_or_not():
    tools = validate_tools([WEATHER, NO_PARAMS])
    output = json.dumps(
        [
            {"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "ping", "parameters": {}},
        ],
        indent=1,
    )
    p = forced_tool_parser(ToolChoice("required"), tools)
    result = p.extract(output)
    assert [(c.name, c.arguments) for c in result.calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("ping", "{}"),
    ]
    assert result.content is None
    for chunks in ([output], list(output)):
        got = assemble(stream(p, chunks))
        assert got.named_calls == [(c.name, c.arguments) for c in result.calls]
    one = forced_tool_parser(ToolChoice("required"), tools, parallel_tool_calls=False)
    assert [c.name for c in one.extract(output).calls] == ["get_weather"]


def test_named_output_becomes_one_call_announced_at_once():
    p = forced_tool_parser(ToolChoice("named", "get_weather"), validate_tools([WEATHER]))
    output = '{ "city" : "Paris" }'
    [call] = p.extract(output).calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    state = p.stream()
    first = state.feed("{")
    assert first[0].tool_call.name == "get_weather" and first[0].tool_call.id
    got = assemble(first + [d for ch in output[1:] for d in state.feed(ch)] + state.finish())
    assert got.named_calls == [("get_weather", '{"city": "Paris"}')]
    assert p.extract("not json").calls == []


def test_finish_reason_rules():
    auto, required, named = ToolChoice("auto"), ToolChoice("required"), ToolChoice("named", "f")
    assert chat_finish_reason("stop", auto, 1) == "tool_calls"
    assert chat_finish_reason("stop", required, 2) == "tool_calls"
    assert chat_finish_reason("stop", named, 1) == "stop"
    assert chat_finish_reason("stop", auto, 0) == "stop"
    assert chat_finish_reason("length", auto, 1) == "length"


# --- --tool-call-parser names and --tool-parser-plugin --------------------------------------


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_PARSERS", dict(registry._PARSERS))


PLUGIN = '''
from frontend.tool_parsers import ToolParser, register_tool_parser
from frontend.tool_parsers.base import CallScan, Scan

@register_tool_parser("call_colon")
class CallColon(ToolParser):
    """`CALL:name` lines; no arguments."""

    def scan(self, text, final):
        scan = Scan(segments=[text])
        at = text.find("CALL:")
        if at >= 0 and (final or text.endswith("\\n")):
            scan.segments[0] = text[:at]
            call = self.open_call(scan, at)
            call.name, call.arguments, call.complete = text[at + 5:].strip(), "{}", True
        elif at >= 0:
            scan.segments[0] = text[:at]
        return scan
'''


def test_a_plugin_file_adds_a_parser_by_name(tmp_path, clean_registry):
    path = tmp_path / "my_parser.py"
    path.write_text(PLUGIN)
    assert load_tool_parser_plugin(path) == ["call_colon"]
    p = get_tool_parser("call_colon")()
    result = p.extract("Sure. CALL:lookup")
    assert (result.content, [c.name for c in result.calls]) == ("Sure. ", ["lookup"])
    assert assemble(stream(p, list("Sure. CALL:lookup"))).named_calls == [("lookup", "{}")]


def test_unknown_parser_names_list_the_known_ones():
    with pytest.raises(ToolParserError) as e:
        get_tool_parser("hermes2")
    for name in ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "qwen3_coder"):
        assert name in str(e.value)


def test_broken_plugins_give_a_clear_start_up_error(tmp_path, clean_registry):
    with pytest.raises(ToolParserError, match="is not a file"):
        load_tool_parser_plugin(tmp_path / "missing.py")
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from frontend.tool_parsers import register_tool_parser\n"
        "register_tool_parser('half')(object)\n"
    )
    with pytest.raises(ToolParserError, match="bad.py failed to load: TypeError"):
        load_tool_parser_plugin(bad)
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def (:\n")
    with pytest.raises(ToolParserError, match="SyntaxError"):
        load_tool_parser_plugin(syntax)
    assert "half" not in registry.tool_parser_names()


# --- history for chat templates -------------------------------------------------------------


def test_history_arguments_become_dicts_and_reasoning_gets_both_names():
    messages = template_messages(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "reasoning": "think",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1}'},
                    },
                    {"function": {"name": "g", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ]
    )
    assert messages[1]["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "f", "arguments": {"a": 1}}},
        {"type": "function", "function": {"name": "g", "arguments": {}}},
    ]
    assert messages[1]["reasoning_content"] == messages[1]["reasoning"] == "think"
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}


@pytest.mark.parametrize(
    "message,param",
    [
        ({"role": "assistant", "tool_calls": "x"}, "messages[0].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            "messages[0].tool_calls[0].function.name",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": 5, "function": {"name": "f"}}]},
            "messages[0].tool_calls[0].id",
        ),
        ({"role": "tool", "tool_call_id": "x" * 300, "content": ""}, "messages[0].tool_call_id"),
        ({"role": "assistant", "reasoning": 5}, "messages[0].reasoning"),
    ],
)
def test_bad_history_names_the_field(message, param):
    with pytest.raises(ToolRequestError) as e:
        template_messages([message])
    assert e.value.param == param


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))


def render(tokenizer, template, messages, **kw):
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, **kw
    )


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ],
    [
        {"role": "user", "content": "héllo ✓ <think>"},
        {"role": "assistant", "content": "x\n\ny"},
        {"role": "narrator", "content": ""},
        {"role": "system", "content": "late"},
        {"role": "assistant", "content": "Hi"},
    ],
    [{"role": "system", "content": "only"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_tools_template_renders_plain_chats_exactly_as_chatml(tokenizer, messages):
    for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        assert render(tokenizer, CHATML_TOOLS, messages, **kw) == render(
            tokenizer, CHATML, messages, **kw
        )
    for kw in ({"add_generation_prompt": False}, {"continue_final_message": True}):
        plain = tokenizer.apply_chat_template(messages, chat_template=CHATML, tokenize=False, **kw)
        tools = tokenizer.apply_chat_template(
            messages, chat_template=CHATML_TOOLS, tokenize=False, **kw
        )
        assert tools == plain


def test_the_tools_template_round_trips_calls_through_the_hermes_parser(tokenizer):
    tools = validate_tools([WEATHER, NO_PARAMS])
    calls = [("get_weather", {"city": "Zürich"}), ("ping", {})]
    history = template_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": n, "arguments": json.dumps(a)},
                    }
                    for i, (n, a) in enumerate(calls)
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_1", "content": "pong"},
        ]
    )
    text = render(tokenizer, CHATML_TOOLS, history, tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(tools[0], ensure_ascii=False) in text
    assert "<tool_response>\n18C\n</tool_response>\n<tool_response>\npong\n</tool_response>" in text
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    result = get_tool_parser("hermes")().extract(assistant)
    assert result.content == "Checking.\n"
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls
    assert assistant.replace("\n", "") == hermes(calls, before="Checking.").replace("\n", "")
