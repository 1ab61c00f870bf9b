"""`tool_choice: "required"` and named choices: what structured outputs constrain decoding to,
and the parsers that read the constrained output back into calls.

- required: a JSON array of at least one (at most one with `parallel_tool_calls: false`)
  `{"name": <one of the tools>, "parameters": <that tool's schema>}`.
- named: the chosen tool's arguments object itself, as vLLM does: no name to generate.
"""

from __future__ import annotations

import copy
from typing import Any

from frontend.tool_parsers.base import Scan, ToolLimits, ToolParser
from frontend.tool_parsers.json_args import (
    Malformed,
    canonical_arguments,
    skip_ws,
    stable_prefix,
    value_end,
)
from frontend.tool_parsers.json_calls import scan_call_list
from frontend.tool_parsers.request import ToolChoice

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def required_tools_schema(tools: list[dict], *, parallel_tool_calls: bool = True) -> dict:
    """The schema for `tool_choice: "required"` over validated `tools`. Each tool's local
    `$ref`s still resolve: its `$defs` move to the top as `<tool>.<name>`."""
    defs: dict[str, Any] = {}
    variants = []
    for k, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        where = f"/items/anyOf/{k}/properties/parameters"
        parameters = _relocate(function.get("parameters") or _EMPTY_OBJECT, name, where, defs)
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_tool_schema(tools: list[dict], name: str) -> dict:
    """The schema for a named choice: that tool's parameters (the output is its arguments)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return copy.deepcopy(tool["function"].get("parameters") or _EMPTY_OBJECT)
    raise KeyError(name)


def _relocate(schema: dict, tool: str, where: str, defs: dict) -> dict:
    """A copy of `schema` fit to sit at JSON pointer `where`: its definitions go to `defs`."""
    schema = copy.deepcopy(schema)
    own = {}
    for key in ("$defs", "definitions"):
        for def_name, definition in (schema.pop(key, None) or {}).items():
            own[f"#/{key}/{_escape(def_name)}"] = f"#/$defs/{_escape(f'{tool}.{def_name}')}"
            defs[f"{tool}.{def_name}"] = definition
    _rewrite_refs(schema, own, where)
    for def_name in [d for d in defs if d.startswith(f"{tool}.")]:
        _rewrite_refs(defs[def_name], own, where)
    return schema


def _rewrite_refs(node: Any, moved: dict[str, str], where: str) -> None:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                item["$ref"] = _moved_ref(ref, moved, where)
            stack.extend(v for k, v in item.items() if k != "$ref")


def _moved_ref(ref: str, moved: dict[str, str], where: str) -> str:
    for old, new in moved.items():
        if ref == old or ref.startswith(old + "/"):
            return new + ref[len(old) :]
    return "#" + where + ref[1:]  # another spot of the tool's own schema


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


class RequiredToolParser(ToolParser):
    """Reads output constrained by `required_tools_schema`."""

    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        i = skip_ws(text, 0)
        if i == len(text):
            return scan
        if text[i] != "[":
            return scan.fail(self.open_call(scan, 0), "expected a JSON list of tool calls")
        return scan_call_list(text, 0, i, scan, self.open_call, ("parameters",))


class NamedToolParser(ToolParser):
    """Reads output constrained by `named_tool_schema`: the arguments of one known call."""

    name = "named"

    def __init__(
        self, function_name: str, tools: list[dict] | None = None, limits: ToolLimits | None = None
    ):
        super().__init__(tools, limits)
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        call = self.open_call(scan, 0)
        call.name = self.function_name
        i = skip_ws(text, 0)
        if i == len(text):
            return scan
        try:
            end = value_end(text, i)
            if end is None:
                call.arguments = stable_prefix(text[i:])
                return scan
            call.arguments = canonical_arguments(text[i:end])
        except Malformed as e:
            return scan.fail(call, e)
        if text[end:].strip():
            return scan.fail(call, "text after the arguments object")
        call.complete = True
        return scan


def forced_tool_parser(
    choice: ToolChoice,
    tools: list[dict],
    limits: ToolLimits | None = None,
    *,
    parallel_tool_calls: bool = True,
) -> ToolParser:
    """The parser for a `required` or named choice."""
    if choice.mode == "named":
        return NamedToolParser(choice.name or "", tools, limits)
    if choice.mode == "required":
        return RequiredToolParser(tools, limits, parallel_tool_calls=parallel_tool_calls)
    raise ValueError(f"tool_choice {choice.mode!r} is not a forced choice")


def chat_finish_reason(engine_reason: str | None, choice: ToolChoice, calls: int) -> str | None:
    """`tool_calls` when a message that ended normally made calls under `auto` or `required`;
    a named choice keeps `stop` (as vLLM and OpenAI do), and a cut-off message keeps `length`."""
    if engine_reason == "stop" and calls and choice.mode in ("auto", "required"):
        return "tool_calls"
    return engine_reason
