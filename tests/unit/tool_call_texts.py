"""Helpers for the tool-parser tests: streaming a text in chunks, reassembling the deltas the
way an OpenAI client does, and writing calls in each model format."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import orjson

from frontend.chat_deltas import DeltaMessage
from frontend.tool_parsers import ToolParser

OPENAI_ID = re.compile(r"call_[A-Za-z0-9]{24}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


@dataclass
class Assembled:
    content: str | None
    calls: list[tuple[str, str, str]]  # (id, name, arguments)

    @property
    def named_calls(self) -> list[tuple[str, str]]:
        return [(name, args) for _, name, args in self.calls]


def stream(parser: ToolParser, chunks: list[str]) -> list[DeltaMessage]:
    state = parser.stream()
    deltas = []
    for chunk in chunks:
        deltas += state.feed(chunk)
    return deltas + state.finish()


def assemble(deltas: list[DeltaMessage]) -> Assembled:
    """What a client accumulating the chunks ends up with; asserts the OpenAI delta rules."""
    content = []
    calls: list[list[str]] = []
    for d in deltas:
        shape = d.to_dict()
        assert len(shape) == 1, shape
        orjson.dumps(shape)  # what the SSE writer does: fails on text that is not UTF-8
        if d.tool_call is None:
            text = d.content if d.content is not None else d.reasoning
            assert text, "an empty delta went out"
            if d.content is not None:
                content.append(d.content)
            continue
        piece = shape["tool_calls"][0]
        if d.tool_call.id is not None:
            assert piece["index"] == len(calls), "calls must start in index order"
            assert piece["type"] == "function" and "name" in piece["function"]
            calls.append([piece["id"], piece["function"]["name"], piece["function"]["arguments"]])
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            assert piece["index"] == len(calls) - 1, "arguments only for the latest call"
            assert piece["function"]["arguments"], "an empty arguments delta went out"
            calls[-1][2] += piece["function"]["arguments"]
    joined = "".join(content)
    return Assembled(joined or None, [tuple(c) for c in calls])


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# Writing calls the way each format's models do; `style` varies the JSON layout.
def json_text(value, style: int) -> str:
    if style == 1:
        return json.dumps(value, ensure_ascii=True)
    if style == 2:
        return json.dumps(value, ensure_ascii=False, indent=2)
    if style == 3:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(value, ensure_ascii=False)


def hermes(calls, before="", after="", style=0) -> str:
    body = "".join(
        f"<tool_call>\n{json_text({'name': n, 'arguments': a}, style)}\n</tool_call>\n"
        for n, a in calls
    )
    return before + body + after


def llama3(calls, tag=True, style=0) -> str:
    objs = "; ".join(json_text({"name": n, "parameters": a}, style) for n, a in calls)
    return ("<|python_tag|>" if tag else "") + objs


def mistral_list(calls, before="", style=0) -> str:
    return (
        before + "[TOOL_CALLS]" + json_text([{"name": n, "arguments": a} for n, a in calls], style)
    )


def mistral_v11(calls, before="", style=0, args_tag=False) -> str:
    sep = "[ARGS]" if args_tag else ""
    return before + "".join(f"[TOOL_CALLS]{n}{sep}{json_text(a, style)}" for n, a in calls)


def pythonic(calls) -> str:
    return (
        "["
        + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls)
        + "]"
    )


def qwen3_xml(calls, before="", after="") -> str:
    """`calls` values are already the raw parameter text."""
    out = []
    for name, params in calls:
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
        out.append(f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>")
    return before + "\n".join(out) + after
