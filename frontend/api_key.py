"""The API key check both doors share: `Authorization: Bearer <key>`, the scheme
case-insensitive (RFC 7235), compared in constant time so the key cannot be guessed
byte by byte from response times."""

from __future__ import annotations

import hmac


def bearer_matches(value: bytes | str | None, expected: bytes) -> bool:
    """Whether an Authorization value carries `expected` as its bearer token."""
    if value is None:
        return hmac.compare_digest(b"", expected)
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    scheme, _, token = value.partition(b" ")
    given = token.strip() if scheme.lower() == b"bearer" else b""
    return hmac.compare_digest(given, expected)


def key_matches(value: bytes | None, expected: bytes) -> bool:
    """Whether an `x-api-key` value (Anthropic's clients send the key there) is `expected`."""
    return value is not None and hmac.compare_digest(value.strip(), expected)
