"""POST /v1/responses, its request: OpenAI's Responses fields (and vLLM's sampling extras),
turned into the chat request the chat pipeline serves (serving_chat.submit_chat).

What maps: `input` (a string, or items: messages with text parts, `function_call` and
`function_call_output`; `reasoning` items are dropped, as chat templates take no earlier
thoughts), `instructions` (a system message first), `max_output_tokens`, function
`tools` and `tool_choice`, `text.format` (text, json_object, json_schema), and
`reasoning.effort` (the chat template's `reasoning_effort`). What zserve cannot do is
refused by name: stored responses (`previous_response_id`, `item_reference`,
`background`), tools other than functions, images and files, `truncation: auto`.
`store` is accepted and nothing is stored, as vLLM does by default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from frontend.errors import APIError
from frontend.limits import RequestLimits, check_message_count
from frontend.openai_models import ChatCompletionRequest, SamplingFields, check_one_answer

_TEXT_PARTS = ("input_text", "output_text", "text")
# OpenAI's limits on `metadata`, which every Response (three times in a stream) echoes.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class ResponsesRequest(SamplingFields):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "auto"
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_responses(self):
        check_one_answer(self, "/v1/responses")
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata: keys hold at most {MAX_METADATA_KEY_CHARS} characters and "
                    f"values {MAX_METADATA_VALUE_CHARS}"
                )
        if self.previous_response_id is not None:
            raise ValueError(
                "previous_response_id: zserve stores no responses; send the conversation "
                "so far in input"
            )
        if self.background:
            raise ValueError("background: not supported (zserve stores no responses)")
        if self.truncation == "auto":
            raise ValueError(
                "truncation: 'auto' is not supported; zserve never drops input items "
                "(shorten the input, or use truncate_prompt_tokens)"
            )
        return self

    @property
    def wants_logprobs(self) -> bool:
        include = self.include or ()
        return bool(self.top_logprobs) or "message.output_text.logprobs" in include


def chat_request(body: ResponsesRequest, limits: RequestLimits) -> ChatCompletionRequest:
    """The chat request with the same meaning; every refusal names its Responses field."""
    messages = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        check_message_count(len(body.input), limits, "input")  # before reading any of them
        messages.extend(_messages(body.input))
    if not messages:
        raise APIError("input: must hold at least one item", param="input")
    fields = body.model_dump(
        exclude={
            "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
            "reasoning", "top_logprobs", "include", "metadata", "store", "background",
            "previous_response_id", "truncation",
        },
        exclude_unset=True,
    )  # fmt: skip
    fields["messages"] = messages
    fields["max_completion_tokens"] = body.max_output_tokens
    fields["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)] if body.tools else None
    fields["tool_choice"] = _tool_choice(body.tool_choice) if body.tools else None
    fields["response_format"] = _response_format(body.text)
    if body.wants_logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs or 0
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        fields["chat_template_kwargs"] = {"reasoning_effort": effort} | (
            body.chat_template_kwargs or {}
        )
    return ChatCompletionRequest.model_validate(fields)


def _messages(items: list[dict[str, Any]]) -> list[dict]:
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}]: must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {
                "id": string_field(item, "call_id", f"input[{i}]"),
                "type": "function",
                "function": {
                    "name": string_field(item, "name", f"input[{i}]"),
                    "arguments": string_field(item, "arguments", f"input[{i}]"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise APIError(f"input[{i}].output: must be a string", param=f"input[{i}].output")
            call_id = string_field(item, "call_id", f"input[{i}]")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":
            raise APIError(
                f"input[{i}].type: {kind!r} is not supported (message, function_call, "
                f"function_call_output and reasoning items are)",
                param=f"input[{i}].type",
            )
    return messages


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(
            f"input[{i}].role: must be user, assistant, system or developer, got {role!r}",
            param=f"input[{i}].role",
        )
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise APIError(
                    f"input[{i}].content[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are "
                    f"supported, got {kind!r}",
                    param=f"input[{i}].content[{j}]",
                )
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise APIError(
            f"input[{i}].content: must be a string or a list of text parts",
            param=f"input[{i}].content",
        )
    # The developer role is the system role of chat templates.
    return {"role": "system" if role == "developer" else role, "content": content}


def string_field(obj: dict, key: str, at: str) -> str:
    """obj[key], which must be a string (`at`: where obj stands, for the error)."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise APIError(f"{at}.{key}: must be a string", param=f"{at}.{key}")
    return value


def _tool(tool: dict, i: int) -> dict:
    kind = tool.get("type")
    if kind != "function":
        raise APIError(
            f"tools[{i}].type: {kind!r} is not supported; zserve calls function tools only",
            param=f"tools[{i}].type",
        )
    if not isinstance(tool.get("name"), str):
        raise APIError(f"tools[{i}].name: must be a string", param=f"tools[{i}].name")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        "tool_choice: must be auto, none, required or {type: function, name}",
        param="tool_choice",
    )


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(
        "text.format.type: must be text, json_object or json_schema", param="text.format.type"
    )
