"""Server-sent events, framed by hand: `data: <json>\\n\\n`, ending with `data: [DONE]`."""

from __future__ import annotations

import orjson

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def event(payload: dict) -> bytes:
    """Hot path: one call per streamed chunk."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"
