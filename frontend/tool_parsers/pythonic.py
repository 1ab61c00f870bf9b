"""`pythonic`: a message that is a Python list of calls from its start, `[f(a=1, b="x"), g()]`
(Llama 3.2, Llama 4, ToolACE). Read with `ast`, never evaluated; keyword arguments only.

A message that starts any other way is plain content; text after the list is content.
"""

from __future__ import annotations

import re

from frontend.tool_parsers.base import CallScan, Scan, ToolParser
from frontend.tool_parsers.json_args import MAX_DEPTH, Malformed, dumps, skip_ws
from frontend.tool_parsers.py_literals import parse_literal
from frontend.tool_parsers.registry import register_tool_parser

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRUCT = re.compile(r"[()\[\]{},'\"#]")
_CLOSER = {"(": ")", "[": "]", "{": "}"}
_STRING_TAIL = {
    '"': re.compile(r'(?:[^"\\]|\\.)*"', re.S),
    "'": re.compile(r"(?:[^'\\]|\\.)*'", re.S),
    '"""': re.compile(r'(?:[^"\\]|\\.|"(?!""))*"""', re.S),
    "'''": re.compile(r"(?:[^'\\]|\\.|'(?!''))*'''", re.S),
}


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    def starts_plain(self, head: str) -> bool | None:
        i = skip_ws(head, 0)
        return None if i == len(head) else head[i] != "["

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if i == len(text) or text[i] != "[":
            return Scan(segments=[text])
        scan = Scan()
        call = self.open_call(scan, 0)  # the first call owns the "[": all is content if broken
        i = skip_ws(text, i + 1)
        while i < len(text):
            try:
                end = _read_call(text, i, call)
                if end is None:
                    return scan
                call.complete = True
                j = skip_ws(text, end)
                if j < len(text) and text[j] == ",":
                    j = skip_ws(text, j + 1)
                if j == len(text):
                    return scan
                if text[j] == "]":
                    scan.segments[-1] = text[j + 1 :]
                    return scan
                if text[end:j].strip() != ",":
                    raise Malformed("expected ',' or ']' after a call")
            except Malformed as e:
                return scan.fail(call, e)
            call = self.open_call(scan, j)
            if call.error:
                return scan
            i = j
        return scan


def _read_call(text: str, pos: int, call: CallScan) -> int | None:
    """`name(k=v, ...)` at `pos`: the index past `)`, or None while unfinished."""
    m = _IDENT.match(text, pos)
    if m is None:
        raise Malformed("expected a function name")
    j = skip_ws(text, m.end())
    if j == len(text):
        return None
    if text[j] != "(":
        raise Malformed("expected '(' after the function name")
    call.name = m.group()
    members: list[str] = []
    seen: set[str] = set()
    k = skip_ws(text, j + 1)
    while k < len(text):
        if text[k] == ")":
            call.arguments = "{" + ", ".join(members) + "}"
            return k + 1
        key = _IDENT.match(text, k)
        if key is None:
            raise Malformed("only keyword arguments are supported")
        e = skip_ws(text, key.end())
        if e == len(text):
            break
        if text[e] != "=" or text.startswith("==", e):
            raise Malformed("only keyword arguments are supported")
        end = _expression_end(text, e + 1)
        if end is None:
            break
        if key.group() in seen:
            raise Malformed(f"keyword argument {key.group()!r} repeated")
        seen.add(key.group())
        value = parse_literal(text[e + 1 : end])
        members.append(f"{dumps(key.group())}: {dumps(value)}")
        k = skip_ws(text, end + 1) if text[end] == "," else end
    call.arguments = "{" + ", ".join(members)
    return None


def _expression_end(text: str, pos: int) -> int | None:
    """The index of the `,` or `)` ending the argument value that starts at `pos`, or None
    if the text ends first."""
    stack: list[str] = []
    i = pos
    while True:
        m = _STRUCT.search(text, i)
        if m is None:
            return None
        c = m.group()
        i = m.end()
        if c in "'\"":
            quote = c * 3 if text.startswith(c * 3, m.start()) else c
            tail = _STRING_TAIL[quote].match(text, m.start() + len(quote))
            if tail is None:
                return None
            i = tail.end()
        elif c in _CLOSER:
            stack.append(_CLOSER[c])
            if len(stack) > MAX_DEPTH:
                raise Malformed(f"argument nested deeper than {MAX_DEPTH} levels")
        elif c == "#":
            raise Malformed("comments are not supported in calls")
        elif not stack:
            if c in ",)":
                return m.start()
            raise Malformed(f"unbalanced {c!r}")
        elif c != ",":
            if stack.pop() != c:
                raise Malformed(f"mismatched {c!r}")
