"""POST /v1/messages, its request: Anthropic's Messages fields (and vLLM's sampling
extras), turned into the chat request the chat pipeline serves, as vLLM does.

What maps: `system` (a string or text blocks: a system message first), `messages` with
text, `tool_use` and `tool_result` blocks (`thinking` blocks are dropped, as chat
templates take no earlier thoughts), `max_tokens`, `stop_sequences`, client `tools`
(`input_schema` as the function's parameters) and `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`), and `thinking` (the template's `enable_thinking`). Images,
documents and Anthropic's server tools are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, model_validator

from frontend.errors import APIError
from frontend.limits import RequestLimits, check_message_count, check_stop_strings
from frontend.openai_models import ChatCompletionRequest, SamplingFields, check_one_answer
from frontend.responses_input import string_field

# The request fields of their own; everything else is a chat (sampling) field as is.
_OWN = {"messages", "system", "max_tokens", "stop_sequences", "tools", "tool_choice", "thinking"}


class MessagesRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_tokens: int = Field(..., ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_messages(self):
        check_one_answer(self, "/v1/messages")
        return self


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # not part of a count_tokens request


def chat_request(body: MessagesRequest, limits: RequestLimits) -> ChatCompletionRequest:
    check_message_count(len(body.messages), limits)
    check_stop_strings(body.stop_sequences or [], limits, "stop_sequences")
    messages = []
    if body.system is not None:
        messages.append({"role": "system", "content": _system_text(body.system)})
    for i, message in enumerate(body.messages):
        messages.extend(_message(message, i))
    fields = body.model_dump(exclude=_OWN | {"metadata"}, exclude_unset=True)
    fields["messages"] = messages
    fields["max_completion_tokens"] = body.max_tokens
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    if body.tools:
        fields["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
        fields["tool_choice"], parallel = _tool_choice(body.tool_choice)
        if parallel is False:
            fields["parallel_tool_calls"] = False
    thinking = (body.thinking or {}).get("type")
    if thinking in ("enabled", "disabled"):
        fields["chat_template_kwargs"] = {"enable_thinking": thinking == "enabled"} | (
            body.chat_template_kwargs or {}
        )
    return ChatCompletionRequest.model_validate(fields)


def _system_text(system: str | list) -> str:
    if isinstance(system, str):
        return system
    return "".join(_block_text(block, "system", j) for j, block in enumerate(system))


def _block_text(block: Any, where: str, j: int) -> str:
    if (
        not isinstance(block, dict)
        or block.get("type") != "text"
        or not isinstance(block.get("text"), str)
    ):
        kind = block.get("type") if isinstance(block, dict) else None
        raise APIError(
            f"{where}[{j}]: only text blocks are supported here, got {kind!r}",
            param=f"{where}[{j}]",
        )
    return block["text"]


def _message(message: dict, i: int) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results become tool
    messages (before its text); an assistant turn's tool uses become its tool calls."""
    where = f"messages[{i}]"
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise APIError(
            f"{where}.role: must be user or assistant, got {role!r}", param=f"{where}.role"
        )
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(
            f"{where}.content: must be a string or a list of blocks", param=f"{where}.content"
        )
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            text.append(_block_text(block, f"{where}.content", j))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input", {}))
            calls.append({"id": string_field(block, "id", at), "type": "function",
                          "function": {"name": string_field(block, "name", at), "arguments": arguments}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            results.append(
                {"role": "tool", "tool_call_id": string_field(block, "tool_use_id", at),
                 "content": _result_text(block.get("content", ""), at)}
            )  # fmt: skip
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(
                f"{at}.type: {kind!r} is not supported in a {role} message (text, "
                f"tool_use from the assistant, tool_result from the user)",
                param=f"{at}.type",
            )
    out = results
    if calls:
        out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
    elif text or not results:
        out.append({"role": role, "content": "".join(text)})
    return out


def _result_text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_block_text(block, f"{at}.content", j) for j, block in enumerate(content))
    raise APIError(f"{at}.content: must be a string or text blocks", param=f"{at}.content")


def _tool(tool: dict, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(
            f"tools[{i}].type: {kind!r} is not supported; zserve calls client tools only",
            param=f"tools[{i}].type",
        )
    function = {"name": string_field(tool, "name", f"tools[{i}]")}
    if "description" in tool:
        function["description"] = tool["description"]
    function["parameters"] = tool.get("input_schema") or {"type": "object"}
    return {"type": "function", "function": function}


def _tool_choice(choice: dict | None) -> tuple[str | dict, bool | None]:
    """(chat's tool_choice, whether parallel calls are allowed: None for the default)."""
    if choice is None:
        return "auto", None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(
        "tool_choice.type: must be auto, any, tool (with a name) or none", param="tool_choice"
    )
