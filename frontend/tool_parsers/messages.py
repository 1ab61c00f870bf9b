"""Tool-calling history in a conversation, made ready for Hugging Face chat templates.

OpenAI clients send an assistant turn's calls with `function.arguments` as a JSON string;
chat templates (Llama 3.1, Qwen, Mistral, Hermes) expect a dict, as transformers documents,
so the string is parsed here (vLLM does the same). An assistant turn's earlier `reasoning`
(or the older `reasoning_content`) is passed on under both names, the one templates read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from frontend.tool_parsers.request import ToolRequestError


@dataclass(frozen=True)
class HistoryLimits:
    max_calls_per_message: int = 128
    max_id_chars: int = 256


def template_messages(
    messages: list[dict[str, Any]], limits: HistoryLimits | None = None
) -> list[dict[str, Any]]:
    """Copies of `messages` (dicts as the chat template will see them) with tool calls
    normalized; raises ToolRequestError naming the field for a malformed one."""
    limits = limits or HistoryLimits()
    result = []
    for i, message in enumerate(messages):
        message = dict(message)
        where = f"messages[{i}]"
        if message.get("role") == "assistant":
            if message.get("tool_calls") is not None:
                message["tool_calls"] = _tool_calls(message["tool_calls"], where, limits)
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise ToolRequestError(
                        f"{where}.reasoning: must be a string", f"{where}.reasoning"
                    )
                message["reasoning"] = message["reasoning_content"] = reasoning
        elif message.get("role") == "tool":
            _check_id(message.get("tool_call_id"), f"{where}.tool_call_id", limits, required=False)
        result.append(message)
    return result


def _tool_calls(calls: Any, where: str, limits: HistoryLimits) -> list[dict]:
    if not isinstance(calls, list):
        raise ToolRequestError(f"{where}.tool_calls: must be a list", f"{where}.tool_calls")
    if len(calls) > limits.max_calls_per_message:
        raise ToolRequestError(
            f"{where}.tool_calls: at most {limits.max_calls_per_message} calls per message",
            f"{where}.tool_calls",
        )
    result = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ToolRequestError(f"{at}.function: must be an object", f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRequestError(
                f"{at}.function.name: must be a non-empty string", f"{at}.function.name"
            )
        clean: dict[str, Any] = {"type": "function"}
        if call.get("id") is not None:
            clean["id"] = _check_id(call["id"], f"{at}.id", limits, required=True)
        clean["function"] = {
            "name": name,
            "arguments": _arguments(function.get("arguments"), f"{at}.function.arguments"),
        }
        result.append(clean)
    return result


def _arguments(arguments: Any, param: str) -> dict:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ToolRequestError(f"{param}: not valid JSON ({e})", param) from None
    if not isinstance(arguments, dict):
        raise ToolRequestError(f"{param}: must be a JSON object", param)
    return arguments


def _check_id(value: Any, param: str, limits: HistoryLimits, required: bool) -> Any:
    if value is None and not required:
        return None
    if not isinstance(value, str) or len(value) > limits.max_id_chars:
        raise ToolRequestError(
            f"{param}: must be a string of at most {limits.max_id_chars} characters", param
        )
    return value
