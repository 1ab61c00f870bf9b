"""`qwen3_xml` / `qwen3_coder`: Qwen3-Coder's XML-like calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text, typed by the request's tool schema: strings stay text (and
stream as they arrive), integers, numbers and booleans are converted, objects and arrays are
read as JSON (or Python literals); a value that does not fit its type stays a string, and
`null` is null for any type. One newline after the opening tag and before the closing one is
part of the layout, not the value. A missing `</parameter>` or `<tool_call>` is tolerated.
"""

from __future__ import annotations

from typing import Any

from frontend.text_tags import find_first, held_suffix
from frontend.tool_parsers.base import CallScan, Scan, ToolParser
from frontend.tool_parsers.json_args import Malformed, dumps, loads, skip_ws
from frontend.tool_parsers.py_literals import parse_literal
from frontend.tool_parsers.registry import register_tool_parser

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


@register_tool_parser("qwen3_xml", "qwen3_coder")
class Qwen3XmlToolParser(ToolParser):
    keep_special_tokens = True
    markers = (START, FUNCTION)

    def __init__(self, tools: list[dict[str, Any]] | None = None, limits=None):
        super().__init__(tools, limits)
        self._properties: dict[str, dict] = {}
        for tool in self.tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("parameters"), dict):
                properties = function["parameters"].get("properties")
                if isinstance(properties, dict):
                    self._properties[str(function.get("name"))] = properties

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        pos = 0
        while True:
            at, tag = find_first(text, (START, FUNCTION), pos)
            if at < 0:
                hold = 0 if final else held_suffix(text, (START, FUNCTION), pos)
                scan.segments[-1] = text[pos : len(text) - hold]
                return scan
            scan.segments[-1] = text[pos:at]
            call = self.open_call(scan, at)
            if call.error:
                return scan
            try:
                after = self._read_call(text, at, tag == START, call, final)
            except Malformed as e:
                return scan.fail(call, e)
            if after is None:
                return scan
            pos = after

    def _read_call(
        self, text: str, at: int, wrapped: bool, call: CallScan, final: bool
    ) -> int | None:
        i = at
        if wrapped:
            i = skip_ws(text, at + len(START))
            if not text.startswith(FUNCTION, i):
                if FUNCTION.startswith(text[i:]):
                    return None
                raise Malformed(f"expected {FUNCTION} after {START}")
        i += len(FUNCTION)
        gt = text.find(">", i)
        if gt < 0:
            if len(text) - i > self.limits.max_name_chars:
                raise Malformed("unterminated function name")
            return None
        name = text[i:gt].strip()
        if not name or any(c in name for c in "<\n"):
            raise Malformed(f"bad function name {name[:80]!r}")
        call.name = name
        end = self._read_parameters(text, gt + 1, call, self._properties.get(name, {}))
        if end is None:
            return None
        if not wrapped:
            call.complete = True
            return end
        j = skip_ws(text, end)
        if text.startswith(END, j):
            call.complete = True
            return j + len(END)
        if not final and END.startswith(text[j:]):
            return None
        call.complete = True  # the closing tag is optional: what follows is text again
        return end

    def _read_parameters(self, text: str, pos: int, call: CallScan, properties: dict) -> int | None:
        """Build the arguments from `<parameter=...>` blocks; the index past `</function>`."""
        members: list[str] = []
        seen: set[str] = set()
        i = pos
        while True:
            i = skip_ws(text, i)
            if text.startswith(FUNCTION_END, i):
                call.arguments = "{" + ", ".join(members) + "}"
                return i + len(FUNCTION_END)
            if not text.startswith(PARAMETER, i):
                if any(tag.startswith(text[i:]) for tag in (PARAMETER, FUNCTION_END)):
                    break
                raise Malformed(f"unexpected text inside {FUNCTION}...>")
            gt = text.find(">", i + len(PARAMETER))
            if gt < 0:
                break
            key = text[i + len(PARAMETER) : gt].strip()
            if not key or key in seen:
                raise Malformed(f"missing or repeated parameter name {key[:80]!r}")
            seen.add(key)
            kind = _type_of(properties.get(key))
            head = f"{dumps(key)}: "
            end, tag = find_first(text, _VALUE_ENDS, gt + 1)
            if end < 0:
                members.append(head + _partial_value(text, gt + 1, kind))
                call.arguments = "{" + ", ".join(members)
                return None
            members.append(head + dumps(_typed(_strip_layout(text[gt + 1 : end]), kind)))
            i = end + len(PARAMETER_END) if tag == PARAMETER_END else end
        call.arguments = "{" + ", ".join(members)
        return None


def _strip_layout(raw: str) -> str:
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _partial_value(text: str, start: int, kind: str) -> str:
    """What can be shown of a value still being written: the start of a string, no more."""
    if kind not in _STRING_TYPES:
        return ""
    raw = text[start : len(text) - held_suffix(text, _VALUE_ENDS, start)]
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw  # maybe the layout newline before the tag
    if "null".startswith(raw.lower()):
        return ""  # it may yet be null
    return dumps(raw)[:-1]


def _type_of(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "string"
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def _typed(raw: str, kind: str) -> Any:
    if raw.lower() == "null":
        return None
    if kind in _STRING_TYPES:
        return raw
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(raw)
        if kind.startswith(("num", "float")):
            number = float(raw)
            if number != number or number in (float("inf"), float("-inf")):
                return raw
            return int(number) if number.is_integer() else number
    except ValueError:
        return raw
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(raw.lower(), raw)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return loads(raw)
        except Malformed:
            pass
    try:
        return parse_literal(raw)
    except Malformed:
        return raw
