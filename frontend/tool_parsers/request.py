"""The request side of tool calling: `tools`, `tool_choice` and `parallel_tool_calls` checked
against size and count limits, as plain values and exceptions naming the field (the serving
layer turns a `ToolRequestError` into a 400 with `param`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


class ToolRequestError(ValueError):
    """A bad `tools` / `tool_choice` / tool message; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ToolRequestLimits:
    max_tools: int = 128
    max_description_chars: int = 8192
    max_parameters_bytes: int = 64 * 1024  # one tool's schema, as compact JSON
    max_total_bytes: int = 1024 * 1024  # all tools together
    max_schema_depth: int = 32


@dataclass(frozen=True)
class ToolChoice:
    """What the request asks of tool calling. `name` is set for a named choice."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None


def validate_tools(tools: Any, limits: ToolRequestLimits | None = None) -> list[dict]:
    """`tools` as a list of `{"type": "function", "function": {name, description?,
    parameters?, strict?}}`; raises ToolRequestError naming the offending entry."""
    limits = limits or ToolRequestLimits()
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolRequestError("tools: must be a list of tools", "tools")
    if len(tools) > limits.max_tools:
        raise ToolRequestError(
            f"tools: at most {limits.max_tools} tools per request, got {len(tools)}", "tools"
        )
    seen: set[str] = set()
    total = 0
    result = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolRequestError(
                f'{where}: must be {{"type": "function", "function": ...}}', where
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolRequestError(f"{where}.function: must be an object", f"{where}.function")
        name = _function_name(function.get("name"), f"{where}.function.name")
        if name in seen:
            raise ToolRequestError(
                f"{where}.function.name: {name!r} is given twice", f"{where}.function.name"
            )
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolRequestError(
                f"{where}.function.description: must be a string", f"{where}.function.description"
            )
        if description is not None and len(description) > limits.max_description_chars:
            raise ToolRequestError(
                f"{where}.function.description: longer than {limits.max_description_chars} "
                f"characters",
                f"{where}.function.description",
            )
        parameters = function.get("parameters")
        size = _check_parameters(parameters, f"{where}.function.parameters", limits)
        total += size + len(description or "")
        if total > limits.max_total_bytes:
            raise ToolRequestError(
                f"tools: larger than {limits.max_total_bytes} bytes together", "tools"
            )
        clean = {"name": name}
        if description is not None:
            clean["description"] = description
        if parameters is not None:
            clean["parameters"] = parameters
        if isinstance(function.get("strict"), bool):
            clean["strict"] = function["strict"]
        result.append({"type": "function", "function": clean})
    return result


def _function_name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = repr(name)[:80]
        raise ToolRequestError(
            f"{param}: must be 1 to 64 letters, digits, '_' or '-', got {shown}", param
        )
    return name


def _check_parameters(parameters: Any, param: str, limits: ToolRequestLimits) -> int:
    if parameters is None:
        return 0
    if not isinstance(parameters, dict):
        raise ToolRequestError(f"{param}: must be a JSON schema object", param)
    if _depth(parameters, limits.max_schema_depth) > limits.max_schema_depth:
        raise ToolRequestError(
            f"{param}: nested deeper than {limits.max_schema_depth} levels", param
        )
    try:
        size = len(json.dumps(parameters, separators=(",", ":"), allow_nan=False).encode())
    except (TypeError, ValueError) as e:
        raise ToolRequestError(f"{param}: not JSON ({e})", param) from None
    if size > limits.max_parameters_bytes:
        raise ToolRequestError(
            f"{param}: larger than {limits.max_parameters_bytes} bytes as JSON", param
        )
    kind = parameters.get("type")
    if kind is not None and kind != "object":
        raise ToolRequestError(f'{param}: the schema\'s type must be "object", got {kind!r}', param)
    return size


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of JSON containers, without recursion (a hostile schema may be deep)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return deepest


def validate_tool_choice(tool_choice: Any, tools: list[dict]) -> ToolChoice:
    """The request's `tool_choice` against its (validated) `tools`. Unset means `auto` when
    tools are given and `none` otherwise, as OpenAI does."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ToolRequestError(
                f'tool_choice: "{tool_choice}" needs a non-empty "tools" list', "tool_choice"
            )
        return ToolChoice(tool_choice)
    if isinstance(tool_choice, str):
        raise ToolRequestError(
            f'tool_choice: must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice[:80]!r}',
            "tool_choice",
        )
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ToolRequestError(
            'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ToolRequestError("tool_choice.function: must be an object", "tool_choice.function")
    name = _function_name(function.get("name"), "tool_choice.function.name")
    if not any(t["function"]["name"] == name for t in tools):
        raise ToolRequestError(
            f"tool_choice.function.name: {name!r} is not one of the request's tools",
            "tool_choice.function.name",
        )
    return ToolChoice("named", name)


def tools_for_template(
    tools: list[dict], choice: ToolChoice, exclude_when_none: bool
) -> list[dict] | None:
    """The `tools` the chat template is given: none at all with `tool_choice: "none"` when the
    server runs with --exclude-tools-when-tool-choice-none, as vLLM does."""
    if not tools or (choice.mode == "none" and exclude_when_none):
        return None
    return tools


def check_server_support(
    choice: ToolChoice, *, auto_tool_choice: bool, tool_parser: str | None
) -> None:
    """`auto` needs the server started with --enable-auto-tool-choice and --tool-call-parser
    (vLLM's rule); `required` and named choices are constrained decoding and need neither."""
    if choice.mode == "auto" and not (auto_tool_choice and tool_parser):
        raise ToolRequestError(
            'tool_choice: "auto" (the default when tools are given) needs the server to run '
            "with --enable-auto-tool-choice and --tool-call-parser",
            "tool_choice",
        )
