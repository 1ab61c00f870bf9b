"""Server-sent events, framed by hand: `data: <json>\\n\\n`, ending with `data: [DONE]`."""

from __future__ import annotations

import json

import orjson

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def dumps(payload: dict) -> bytes:
    """Hot path: an answer's JSON. orjson refuses integers past 64 bits, which an answer
    holds only where it echoes a client's free-form field (a Responses request's
    `reasoning`, say); those go through the standard library's encoder, as vLLM's do."""
    try:
        return orjson.dumps(payload)
    except TypeError as e:
        if "64-bit" not in str(e):
            raise
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def event(payload: dict) -> bytes:
    """Hot path: one call per streamed chunk."""
    return b"data: " + dumps(payload) + b"\n\n"


def named_event(kind: str, payload: dict) -> bytes:
    """Hot path: a chunk with an `event:` line (the Responses and Messages streams)."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps(payload) + b"\n\n"
