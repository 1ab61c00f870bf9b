"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of times,
with text before, between and after (Hermes 2 Pro, Qwen2.5, Qwen3 instruct)."""

from __future__ import annotations

from frontend.text_tags import held_suffix
from frontend.tool_parsers.base import CallScan, Scan, ToolParser
from frontend.tool_parsers.json_args import Malformed, skip_ws
from frontend.tool_parsers.json_calls import read_call_object
from frontend.tool_parsers.registry import register_tool_parser

START = "<tool_call>"
END = "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    keep_special_tokens = True  # some checkpoints make the tags special tokens
    markers = (START,)

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        pos = 0
        while True:
            at = text.find(START, pos)
            if at < 0:
                hold = 0 if final else held_suffix(text, (START,), pos)
                scan.segments[-1] = text[pos : len(text) - hold]
                return scan
            scan.segments[-1] = text[pos:at]
            call = self.open_call(scan, at)
            if call.error:
                return scan
            try:
                after = _read_call(text, at + len(START), call, final)
            except Malformed as e:
                return scan.fail(call, e)
            if after is None:
                return scan
            pos = after


def _read_call(text: str, pos: int, call: CallScan, final: bool) -> int | None:
    """The index past the call's closing tag, or None while the call is open."""
    i = skip_ws(text, pos)
    if i == len(text):
        return None
    end = read_call_object(text, i, call, ("arguments",))
    if end is None:
        return None
    j = skip_ws(text, end)
    if text.startswith(END, j):
        call.complete = True
        return j + len(END)
    rest = text[j:]
    if not rest and final:
        call.complete = True  # the closing tag never came, but the call itself is whole
        return j
    if END.startswith(rest) and not final:
        return None
    raise Malformed(f"text after the JSON object inside {START}")
