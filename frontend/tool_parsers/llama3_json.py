"""`llama3_json`: a message that is tool calls from its start, `<|python_tag|>` optional, then
JSON objects `{"name": ..., "parameters" | "arguments": {...}}` separated by `;` (Llama 3.1+).

A message that starts any other way is plain content. Text after the last call is content.
"""

from __future__ import annotations

from frontend.tool_parsers.base import Scan, ToolParser
from frontend.tool_parsers.json_args import Malformed, skip_ws
from frontend.tool_parsers.json_calls import read_call_object
from frontend.tool_parsers.registry import register_tool_parser

PYTHON_TAG = "<|python_tag|>"
ARG_KEYS = ("parameters", "arguments")


@register_tool_parser("llama3_json", "llama4_json")
class Llama3JsonToolParser(ToolParser):
    keep_special_tokens = True  # <|python_tag|> is a special token

    def starts_plain(self, head: str) -> bool | None:
        rest = head[skip_ws(head, 0) :]
        if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
            return None
        return not (rest.startswith("{") or rest.startswith(PYTHON_TAG))

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        tagged = text.startswith(PYTHON_TAG, i)
        if tagged:
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and i < len(text) and PYTHON_TAG.startswith(text[i:]):
            return Scan()  # maybe the tag, maybe text: wait
        if i == len(text) and tagged and not final:
            return Scan()
        if i == len(text) or text[i] != "{":
            return Scan(segments=[text])
        scan = Scan()
        start = 0  # the first call owns the leading tag and spaces: all of it is content if broken
        while True:
            call = self.open_call(scan, start)
            if call.error:
                return scan
            try:
                end = read_call_object(text, i, call, ARG_KEYS)
            except Malformed as e:
                return scan.fail(call, e)
            if end is None:
                return scan
            call.complete = True
            j = skip_ws(text, end)
            if not text.startswith(";", j):
                scan.segments[-1] = text[end:]
                return scan
            i = skip_ws(text, j + 1)
            if i == len(text) or text[i] != "{":
                scan.segments[-1] = text[i:]
                return scan
            start = i
