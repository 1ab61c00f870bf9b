"""Calls written as JSON objects, `{"name": ..., "arguments": {...}}`, alone or in a list."""

from __future__ import annotations

from collections.abc import Callable

from frontend.tool_parsers.base import CallScan, Scan
from frontend.tool_parsers.json_args import (
    Malformed,
    canonical_arguments,
    is_utf8,
    loads,
    object_members,
    skip_ws,
    stable_prefix,
)


def read_call_object(text: str, pos: int, call: CallScan, arg_keys: tuple[str, ...]) -> int | None:
    """Fill `call` from the object at `text[pos]`; the index past it, or None while open.

    The name shows only once the arguments key has appeared too, so a JSON object that is
    not a call (an answer like `{"name": "Ada", "age": 36}`) never gets announced.
    """
    members, end = object_members(text, pos)
    name_m = next((m for m in members if m.key == "name"), None)
    args_m = next((m for m in members if m.key in arg_keys), None)
    if end is not None and (name_m is None or args_m is None):
        missing = "name" if name_m is None else " or ".join(arg_keys)
        raise Malformed(f"tool call object without {missing!r}")
    if args_m is not None:
        call.arguments = _arguments(text, args_m.start, args_m.end)
    if name_m is not None and name_m.end is not None and args_m is not None:
        name = loads(text[name_m.start : name_m.end])
        if not isinstance(name, str) or not name or not is_utf8(name):
            raise Malformed("the function name must be a non-empty string")
        call.name = name
    return end


def _arguments(text: str, start: int, end: int | None) -> str:
    if text[start] == '"':
        # Some models write the arguments object as a JSON string; read what it holds.
        if end is None:
            return ""
        inner = loads(text[start:end])
        return canonical_arguments(inner)
    if end is None:
        return stable_prefix(text[start:])
    return canonical_arguments(text[start:end])


def read_call_list(
    text: str,
    pos: int,
    scan: Scan,
    open_call: Callable[[Scan, int], CallScan],
    arg_keys: tuple[str, ...],
) -> int | None:
    """Read `[{call}, {call}, ...]` at `text[pos]` into `scan`; the index past `]`, or None
    while the list is open (or a call in it is broken: see the call's `error`)."""
    i = skip_ws(text, pos + 1)
    if text.startswith("]", i):
        raise Malformed("empty list of tool calls")
    while i < len(text):
        call = open_call(scan, i)
        if call.error:
            return None
        if text[i] != "{":
            raise Malformed("expected a tool call object in the list")
        end = read_call_object(text, i, call, arg_keys)
        if end is None:
            return None
        call.complete = True
        i = skip_ws(text, end)
        if i == len(text):
            return None
        if text[i] == "]":
            return i + 1
        if text[i] != ",":
            raise Malformed("expected ',' or ']' after a tool call")
        i = skip_ws(text, i + 1)
    return None


def scan_call_list(
    text: str,
    start: int,
    pos: int,
    scan: Scan,
    open_call: Callable[[Scan, int], CallScan],
    arg_keys: tuple[str, ...],
) -> Scan:
    """A list of calls at `text[pos]`, introduced at `start` (a marker, or the list itself);
    text after the list is the last segment."""
    try:
        end = read_call_list(text, pos, scan, open_call, arg_keys)
    except Malformed as e:
        end = None
        scan.fail(scan.calls[-1] if scan.calls else open_call(scan, start), e)
    if not scan.calls:
        open_call(scan, start)
    scan.calls[0].start = start  # a broken first call makes content of it all
    if end is not None:
        scan.segments[-1] = text[end:]
    return scan
