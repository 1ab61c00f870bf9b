"""The request side of structured outputs, tool calling and reasoning in the API server:
constraints read from each field, the server's parsers and flags, and where a constraint
starts when the output begins with reasoning (frontend/structured_outputs.py,
frontend/chat_tools.py, launcher/structured_outputs_flag.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from frontend.chat_tools import (
    ChatParsers,
    chat_tools,
    forced_constraint,
    load_chat_parsers,
    output_parser,
    reasoning_end_ids,
)
from frontend.config import FrontendConfig
from frontend.errors import APIError
from frontend.openai_models import ChatCompletionRequest, CompletionRequest
from frontend.reasoning import Mode, get_reasoning_parser
from frontend.structured_outputs import StructuredOutputOptions, request_constraint
from launcher import serve_args
from launcher.plan import LaunchRefused, build_plan
from launcher.structured_outputs_flag import (
    frontend_options,
    grammar_config,
    parse_structured_outputs_config,
)

OPTIONS = StructuredOutputOptions()
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=USER, **fields)


def test_each_field_states_its_constraint_and_names_itself():
    schema = {"type": "object", "properties": {"z": {}, "a": {}}}
    spec = request_constraint(completion(guided_json=schema), OPTIONS)
    assert json.loads(spec.json) == schema and spec.param == "guided_json"
    assert list(json.loads(spec.json)["properties"]) == ["z", "a"]  # the order is kept
    spec = request_constraint(
        completion(structured_outputs={"regex": "a+", "disable_any_whitespace": True}), OPTIONS
    )
    assert (spec.regex, spec.disable_any_whitespace, spec.param) == (
        "a+",
        True,
        "structured_outputs.regex",
    )
    spec = request_constraint(
        chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}}), OPTIONS
    )
    assert spec.param == "response_format.json_schema.schema"
    spec = request_constraint(completion(response_format={"type": "json_object"}), OPTIONS)
    assert spec.json_object and spec.param == "response_format"
    tag = {"type": "structural_tag", "structures": [], "triggers": ["<"]}
    spec = request_constraint(chat(response_format=tag), OPTIONS)
    assert json.loads(spec.structural_tag) == tag
    assert request_constraint(chat(response_format={"type": "text"}), OPTIONS) is None
    assert request_constraint(completion(), OPTIONS) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_choice": ["a"] * 3}, None),
        ({"guided_choice": ["a"] * 4}, "guided_choice"),
        ({"guided_regex": "a" * 20}, None),
        ({"guided_regex": "a" * 21}, "guided_regex"),
        ({"structured_outputs": {"json": "x" * 21}}, "structured_outputs.json"),
    ],
)
def test_limits_on_size_and_choices_name_the_field(fields, param):
    options = StructuredOutputOptions(max_spec_bytes=20, max_choices=3)
    if param is None:
        assert request_constraint(completion(**fields), options) is not None
        return
    with pytest.raises(APIError) as e:
        request_constraint(completion(**fields), options)
    assert e.value.param == param and e.value.status == 400


def test_a_deeply_nested_schema_is_a_400_not_a_crash():
    deep: dict = {}
    node = deep
    for _ in range(3000):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(APIError) as e:
        request_constraint(completion(guided_json=deep), OPTIONS)
    assert e.value.param == "guided_json"


def test_required_and_named_choices_become_json_schema_constraints():
    parsers = ChatParsers()
    tools = chat_tools(parsers, chat(tools=[TOOL], tool_choice="required"))
    spec = forced_constraint(tools)
    assert json.loads(spec.json)["type"] == "array" and spec.param == "tools"
    named = {"type": "function", "function": {"name": "f"}}
    spec = forced_constraint(chat_tools(parsers, chat(tools=[TOOL], tool_choice=named)))
    assert json.loads(spec.json) == {"type": "object"}
    assert forced_constraint(chat_tools(parsers, chat(tools=[TOOL], tool_choice="none"))) is None


def encode(text: str) -> list[int]:
    return list(text.encode())


def test_a_constraint_starts_after_the_end_of_reasoning_unless_reasoning_is_constrained():
    deepseek = ChatParsers(reasoning_parser=get_reasoning_parser("deepseek_r1"))
    body = chat()
    tools = chat_tools(deepseek, body)
    parser = output_parser(deepseek, body, tools, "<|im_start|>assistant\n")
    assert parser.mode is Mode.REASONING
    assert reasoning_end_ids(deepseek, parser, encode) == encode("</think>")
    everywhere = ChatParsers(reasoning_parser=deepseek.reasoning_parser, constrain_reasoning=True)
    assert reasoning_end_ids(everywhere, parser, encode) is None
    # Qwen3 with enable_thinking false: the template closed the block, output is answer.
    qwen3 = ChatParsers(reasoning_parser=get_reasoning_parser("qwen3"))
    body = chat(chat_template_kwargs={"enable_thinking": False})
    parser = output_parser(qwen3, body, chat_tools(qwen3, body), "assistant\n<think>\n\n</think>")
    assert parser.mode is Mode.CONTENT and reasoning_end_ids(qwen3, parser, encode) is None
    assert reasoning_end_ids(ChatParsers(), None, encode) is None


def test_an_auto_parser_whose_markers_may_be_special_tokens_keeps_them():
    parsers = load_chat_parsers(
        FrontendConfig("m", "m", ["m"], enable_auto_tool_choice=True, tool_call_parser="hermes")
    )
    body = chat(tools=[TOOL])
    parser = output_parser(parsers, body, chat_tools(parsers, body), "")
    assert parser.tools.name == "hermes" and body.skip_special_tokens is False


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zserve")
    serve_args.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "m", *argv])


def planned(*argv: str):
    return build_plan(parse(*argv), "/models/m", "/models/m")


def test_a_plugin_registers_a_parser_the_flag_can_name(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from frontend.tool_parsers import ToolParser, register_tool_parser\n"
        "from frontend.tool_parsers.base import Scan\n\n"
        "@register_tool_parser('my_format')\n"
        "class Mine(ToolParser):\n"
        "    def scan(self, text, final):\n"
        "        return Scan()\n"
    )
    plan = planned("--tool-parser-plugin", str(plugin), "--tool-call-parser", "my_format")
    assert load_chat_parsers(plan.frontend).tool_parser.__name__ == "Mine"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--tool-call-parser", "nope"], ["--tool-call-parser", "'nope'", "pythonic"]),
        (["--enable-auto-tool-choice"], ["--tool-call-parser"]),
        (["--reasoning-parser", "nope"], ["--reasoning-parser", "qwen3"]),
        (["--structured-outputs-config", "reasoning_parser=nope"], ["--reasoning-parser"]),
    ],
)
def test_unknown_parsers_are_refused_before_anything_starts(argv, words):
    with pytest.raises(LaunchRefused) as e:
        planned(*argv)
    assert all(w in str(e.value) for w in words), e.value


def test_the_structured_outputs_config_takes_json_or_pairs_and_splits_into_both_sides():
    settings = parse_structured_outputs_config(
        '{"backend": "xgrammar", "disable_any_whitespace": true, "enable_in_reasoning": true}'
    )
    assert settings == parse_structured_outputs_config(
        "backend=xgrammar, disable_any_whitespace=true,enable_in_reasoning=1"
    )
    settings = parse_structured_outputs_config(
        "max_spec_bytes=1000,compile_timeout_s=2.5,cache_size=4,enable_in_reasoning=true"
    )
    engine, frontend = grammar_config(settings), frontend_options(settings)
    assert (engine.max_spec_bytes, engine.compile_timeout_s, engine.cache_size) == (1000, 2.5, 4)
    assert frontend.max_spec_bytes == 1000 and frontend.enable_in_reasoning
    plan = planned("--structured-outputs-config", "disable_any_whitespace=true")
    assert plan.engine.grammar.disable_any_whitespace
    assert (
        planned("--structured-outputs-config", "reasoning_parser=qwen3").frontend.reasoning_parser
        == "qwen3"
    )


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("backend=guidance", "not available"),
        ("backend=magic", "auto or xgrammar"),
        ("speed=1", "unknown key"),
        ("cache_size=0", ">= 1"),
        ("compile_timeout_s=-1", "seconds"),
        ("disable_any_whitespace=maybe", "true or false"),
        ("[1]", "key=value"),
        ("{oops", "JSON"),
    ],
)
def test_a_bad_structured_outputs_config_says_what_is_wrong(text, words):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        parse_structured_outputs_config(text)
    assert words in str(e.value)
