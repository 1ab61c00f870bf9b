"""JSON in model output: finding where values end, and arguments strings that stream exactly.

A call's `arguments` is always the canonical form `json.dumps(value, ensure_ascii=False)` of the
object the model wrote (vLLM's non-streaming form), whatever spacing the model used. While the
object is still being written, `stable_prefix` gives the longest prefix of that canonical form
that no continuation can change, so streamed fragments concatenate to exactly the final string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from partial_json_parser import Allow, fix_fast

_WS = re.compile(r"[ \t\r\n]*")
_STRUCT = re.compile(r'["{}\[\]]')
_STRING_TAIL = re.compile(r'(?:[^"\\]|\\.)*"', re.S)  # from after an opening quote to its close
_SCALAR = re.compile(r"[^\s,\]}\[{:\"]*")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Partial strings stream; partial numbers and literals wait until complete ("1" may become "1e5").
_PARTIAL = Allow.STR | Allow.OBJ | Allow.ARR
_CLOSER = {"{": "}", "[": "]"}
MAX_DEPTH = 64


class Malformed(ValueError):
    """The model's output cannot be a well-formed call, whatever comes next."""


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def value_end(text: str, pos: int) -> int | None:
    """Index just past the JSON value that starts at `text[pos]`, or None if the text ends
    first. Only finds the boundary; `loads` judges the value."""
    first = text[pos]
    if first == '"':
        m = _STRING_TAIL.match(text, pos + 1)
        return m.end() if m else None
    if first in _CLOSER:
        return _container_end(text, pos)
    end = _SCALAR.match(text, pos).end()
    if end == pos:
        raise Malformed(f"unexpected {first!r} where a JSON value should start")
    return None if end == len(text) else end


def _container_end(text: str, pos: int) -> int | None:
    stack = [_CLOSER[text[pos]]]
    i = pos + 1
    while True:
        m = _STRUCT.search(text, i)
        if m is None:
            return None
        c = m.group()
        i = m.end()
        if c == '"':
            s = _STRING_TAIL.match(text, i)
            if s is None:
                return None
            i = s.end()
        elif c in _CLOSER:
            stack.append(_CLOSER[c])
            if len(stack) > MAX_DEPTH:
                raise Malformed(f"JSON nested deeper than {MAX_DEPTH} levels")
        elif c != stack.pop():
            raise Malformed(f"mismatched {c!r} in JSON")
        elif not stack:
            return i


@dataclass(slots=True)
class Member:
    """One `"key": value` of an object being written; `end` is None while the value is open."""

    key: str
    start: int
    end: int | None


def object_members(text: str, pos: int) -> tuple[list[Member], int | None]:
    """The members of the object starting at `text[pos]` ("{") seen so far, and the index past
    its closing brace (None while open). Raises Malformed as soon as the text cannot be one."""
    if text[pos] != "{":
        raise Malformed("expected a JSON object")
    members: list[Member] = []
    i = skip_ws(text, pos + 1)
    if text.startswith("}", i):
        return members, i + 1
    while True:
        if i == len(text):
            return members, None
        if text[i] != '"':
            raise Malformed("expected a quoted key in JSON object")
        key_end = value_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i == len(text):
            return members, None
        if text[i] != ":":
            raise Malformed("expected ':' after a JSON object key")
        start = skip_ws(text, i + 1)
        if start == len(text):
            return members, None
        end = value_end(text, start)
        members.append(Member(key, start, end))
        if end is None:
            return members, None
        i = skip_ws(text, end)
        if i == len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] != ",":
            raise Malformed("expected ',' or '}' in JSON object")
        i = skip_ws(text, i + 1)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    # A repeated key would let a later value replace one already streamed.
    result = dict(pairs)
    if len(result) != len(pairs):
        raise Malformed("repeated key in JSON object")
    return result


def _no_constants(name: str) -> Any:
    raise Malformed(f"{name} is not JSON")


def loads(text: str) -> Any:
    """Strict JSON: no repeated keys, no NaN/Infinity."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise Malformed(str(e)) from None


def dumps(value: Any) -> str:
    """The canonical arguments form. Refuses what could not go out as UTF-8 JSON."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as e:
        raise Malformed(str(e)) from None
    if _SURROGATE.search(text):
        raise Malformed("lone surrogate in a JSON string")
    return text


def is_utf8(text: str) -> bool:
    """False for text with a lone surrogate (from a `\\ud800` escape): it cannot go out."""
    return _SURROGATE.search(text) is None


def canonical_arguments(text: str) -> str:
    """The arguments string for a complete JSON object written by the model."""
    value = loads(text)
    if not isinstance(value, dict):
        raise Malformed("tool call arguments must be a JSON object")
    return dumps(value)


def stable_prefix(partial: str) -> str:
    """The longest prefix of `canonical_arguments(partial + rest)` that is the same for every
    `rest` completing the object; "" when nothing is certain yet."""
    if not partial.startswith("{"):
        raise Malformed("tool call arguments must be a JSON object")
    try:
        head, tail = fix_fast(partial, _PARTIAL)
    except Exception:  # the library reports odd input with assorted exception types
        return ""
    open_string = tail.startswith('"')
    closers = tail[1:] if open_string else tail
    if closers.strip("]}"):
        return ""  # a completion we cannot account for: wait for more text
    try:
        text = json.dumps(loads(head + tail), ensure_ascii=False, allow_nan=False)
    except Malformed:
        if head + tail != partial:
            return ""  # the library's completion did not parse; more text may fix it
        raise
    cut = len(text) - len(closers) - open_string
    text = text[:cut]
    bad = _SURROGATE.search(text)
    # A high surrogate at the end may still pair up; anywhere else it is final and invalid.
    return text[: bad.start()] if bad else text
