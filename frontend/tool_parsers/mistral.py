"""`mistral`: content, then `[TOOL_CALLS]` and either a JSON list of `{"name", "arguments"}`
objects (tokenizers before v11: Mistral 7B v0.3, Nemo) or, repeated per call,
`[TOOL_CALLS]name{...}` with optional `[CALL_ID]id` and `[ARGS]` before the arguments
(v11 and later). Call ids are 9 letters or digits, as Mistral's templates require."""

from __future__ import annotations

import re

from frontend.text_tags import find_first, held_suffix
from frontend.tool_parsers.base import CallScan, Scan, ToolParser, mistral_call_id
from frontend.tool_parsers.json_args import (
    Malformed,
    canonical_arguments,
    skip_ws,
    stable_prefix,
    value_end,
)
from frontend.tool_parsers.json_calls import scan_call_list
from frontend.tool_parsers.registry import register_tool_parser

MARK = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    keep_special_tokens = True  # [TOOL_CALLS] is a control token
    markers = (MARK,)

    def new_call_id(self) -> str:
        return mistral_call_id()

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        at = text.find(MARK)
        if at < 0:
            scan.segments[0] = text[: len(text) - (0 if final else held_suffix(text, (MARK,)))]
            return scan
        scan.segments[0] = text[:at]
        i = skip_ws(text, at + len(MARK))
        if text.startswith("[", i):
            return scan_call_list(text, at, i, scan, self.open_call, ("arguments",))
        while True:
            call = self.open_call(scan, at)
            if call.error:
                return scan
            try:
                end = self._read_named_call(text, at + len(MARK), call)
            except Malformed as e:
                return scan.fail(call, e)
            if end is None:
                return scan
            call.complete = True
            at = text.find(MARK, end)
            if at < 0:
                hold = 0 if final else held_suffix(text, (MARK,), end)
                scan.segments[-1] = text[end : len(text) - hold]
                return scan
            scan.segments[-1] = text[end:at]

    def _read_named_call(self, text: str, pos: int, call: CallScan) -> int | None:
        """`name[CALL_ID]id[ARGS]{...}` at `pos`: the index past the arguments, or None."""
        k, tag = find_first(text, ("{", ARGS, CALL_ID), pos)
        if k < 0:
            if len(text) - pos > self.limits.max_name_chars:
                raise Malformed("no arguments after the function name")
            return None
        name = text[pos:k].strip()
        if not _NAME.fullmatch(name):
            raise Malformed(f"bad function name {name[:80]!r}")
        if tag == CALL_ID:
            k, tag = find_first(text, ("{", ARGS), k + len(CALL_ID))
            if k < 0:
                return None
        if tag == ARGS:
            k = skip_ws(text, k + len(ARGS))
            if k == len(text):
                return None
        if text[k] != "{":
            raise Malformed("the arguments must be a JSON object")
        call.name = name
        end = value_end(text, k)
        if end is None:
            call.arguments = stable_prefix(text[k:])
            return None
        call.arguments = canonical_arguments(text[k:end])
        return end
