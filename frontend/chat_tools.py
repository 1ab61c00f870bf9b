"""Tool calling and reasoning in chat: the server's parsers, chosen once at start-up, and
what one request's `tools`, `tool_choice` and reasoning make of its prompt, its output
constraint and its output.

- `tool_choice: "auto"` parses what the model writes with `--tool-call-parser`;
- `"required"` and a named function constrain decoding to a JSON schema made from the
  tools (`tool_parsers/forced.py`), so any model returns valid, schema-conforming calls;
- `"none"` leaves the output alone (the template still sees the tools unless
  `--exclude-tools-when-tool-choice-none`);
- with `--reasoning-parser` the reasoning is split off first, and an output constraint
  starts only after it ends (vLLM's semantics), unless `--structured-outputs-config
  enable_in_reasoning=true`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from frontend.chat_output import ChatOutputParser
from frontend.config import FrontendConfig
from frontend.errors import APIError
from frontend.openai_models import ChatCompletionRequest
from frontend.reasoning import Mode, ReasoningParser, get_reasoning_parser, reasoning_boundary
from frontend.tool_parsers import ToolParser, get_tool_parser, load_tool_parser_plugin
from frontend.tool_parsers.forced import (
    forced_tool_parser,
    named_tool_schema,
    required_tools_schema,
)
from frontend.tool_parsers.registry import ToolParserError
from frontend.tool_parsers.request import (
    ToolChoice,
    ToolRequestError,
    check_server_support,
    tools_for_template,
    validate_tool_choice,
    validate_tools,
)
from protocol.messages import StructuredOutputs


@dataclass(frozen=True)
class ChatParsers:
    """The server's chat output formats, from --tool-call-parser and --reasoning-parser."""

    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    auto_tool_choice: bool = False
    exclude_tools_when_none: bool = False
    constrain_reasoning: bool = False  # enable_in_reasoning

    @property
    def tool_parser_name(self) -> str | None:
        return self.tool_parser.name if self.tool_parser is not None else None


def load_chat_parsers(config: FrontendConfig) -> ChatParsers:
    """Load --tool-parser-plugin and resolve the parser names; ToolParserError or
    ReasoningParserError (ValueErrors) say what is wrong with which flag."""
    if config.tool_parser_plugin:
        load_tool_parser_plugin(config.tool_parser_plugin)
    tool = get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None
    if config.enable_auto_tool_choice and tool is None:
        raise ToolParserError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    reasoning = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
    return ChatParsers(
        tool_parser=tool,
        reasoning_parser=reasoning,
        auto_tool_choice=config.enable_auto_tool_choice,
        exclude_tools_when_none=config.exclude_tools_when_tool_choice_none,
        constrain_reasoning=config.structured_outputs.enable_in_reasoning,
    )


@dataclass(frozen=True)
class ChatTools:
    """One request's tool calling: validated tools, the choice, and the template's tools."""

    tools: list[dict]
    choice: ToolChoice
    template_tools: list[dict] | None
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice.mode in ("required", "named")


def chat_tools(parsers: ChatParsers, body: ChatCompletionRequest) -> ChatTools:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`; 400 naming the field."""
    try:
        tools = validate_tools(body.tools)
        choice = validate_tool_choice(body.tool_choice, tools)
        check_server_support(
            choice, auto_tool_choice=parsers.auto_tool_choice, tool_parser=parsers.tool_parser_name
        )
    except ToolRequestError as e:
        raise APIError(e.message, param=e.param) from None
    return ChatTools(
        tools=tools,
        choice=choice,
        template_tools=tools_for_template(tools, choice, parsers.exclude_tools_when_none),
        parallel=body.parallel_tool_calls is not False,
    )


def forced_constraint(tools: ChatTools) -> StructuredOutputs | None:
    """`required` and named choices: the JSON schema their calls must follow."""
    if tools.choice.mode == "required":
        schema = required_tools_schema(tools.tools, parallel_tool_calls=tools.parallel)
    elif tools.choice.mode == "named":
        schema = named_tool_schema(tools.tools, tools.choice.name or "")
    else:
        return None
    return StructuredOutputs(json=json.dumps(schema, ensure_ascii=False), param="tools")


def output_parser(
    parsers: ChatParsers, body: ChatCompletionRequest, tools: ChatTools, prompt: str
) -> ChatOutputParser | None:
    """How this request's output is read: reasoning split off, then tool calls; None
    when it is plain content."""
    reasoning = None
    mode = Mode.CONTENT
    if parsers.reasoning_parser is not None:
        reasoning = parsers.reasoning_parser(body.chat_template_kwargs)
        mode = reasoning.mode_after(prompt)
    tool: ToolParser | None = None
    if tools.forced:
        tool = forced_tool_parser(tools.choice, tools.tools, parallel_tool_calls=tools.parallel)
    elif tools.choice.mode == "auto" and parsers.tool_parser is not None:
        tool = parsers.tool_parser(tools.tools, parallel_tool_calls=tools.parallel)
        if tool.keep_special_tokens:
            body.skip_special_tokens = False  # its markers may be special tokens
    if reasoning is None and tool is None:
        return None
    return ChatOutputParser(reasoning, mode, tool, include_reasoning=body.include_reasoning)


def reasoning_end_ids(
    parsers: ChatParsers, parser: ChatOutputParser | None, encode: Callable[[str], list[int]]
) -> list[int] | None:
    """Where an output constraint starts, in token ids: after the end tag when the
    output starts in (or may open) reasoning; None: from the first token."""
    if parser is None or parser.reasoning is None or parsers.constrain_reasoning:
        return None
    boundary = reasoning_boundary(parser.reasoning, parser.mode, encode)
    return list(boundary.end_ids) if boundary.in_reasoning and boundary.end_ids else None
