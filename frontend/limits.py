"""What one client may ask of an API server: sizes and counts, checked before any work.

Every limit is a `zserve serve` flag with a safe default; every refusal is a 4xx that
names the field and the limit. The checks here are O(1) or linear in what the client
sent, and run before tokenization, so a hostile request costs little to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend.errors import APIError

MiB = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 8 * MiB  # 413
    max_header_bytes: int = 64 * 1024  # request line + headers; 431
    max_header_count: int = 100  # 431
    header_timeout_s: float = 10.0  # from the first byte to the end of the headers; 408
    body_timeout_s: float = 60.0  # from the end of the headers to the end of the body; 408
    max_prompt_chars: int | None = None  # None: what max_model_len can hold as text
    max_prompts: int = 1024  # prompts in one completions request (vLLM's limit)
    max_sequences: int = 1024  # prompts x n of one request
    max_stop_strings: int = 64
    max_stop_chars: int = 1024  # per stop string
    max_request_id_chars: int = 256
    max_messages: int = 1024  # messages of one chat request
    max_concurrent_streams: int = 1024  # gRPC streams one HTTP/2 connection may hold open


def check_request_id(value: str, field: str, limits: RequestLimits) -> None:
    """A client's request id is copied into every engine request and output of its
    request: bounded. Any characters are allowed; the log escapes control characters
    and an echoed header percent-encodes what is not printable ASCII."""
    if not value:
        raise APIError(f"{field} may not be empty", param=field)
    if len(value) > limits.max_request_id_chars:
        raise APIError(
            f"{field} is {len(value)} characters long; at most "
            f"{limits.max_request_id_chars} are allowed (--max-request-id-length)",
            param=field,
        )


def check_prompt_chars(num_chars: int, limit: int, field: str) -> None:
    """Refuse text that cannot fit the context whatever it tokenizes to, before the
    (linear, GIL-holding) tokenizer ever sees it."""
    if num_chars > limit:
        raise APIError(
            f"{field} is {num_chars} characters long; at most {limit} characters can fit in "
            f"this model's context (--max-prompt-chars)",
            param=field,
        )


def check_prompt_count(count: int, limits: RequestLimits, field: str = "prompt") -> None:
    """Prompts (or a batch's conversations) in one request; vLLM's wording."""
    if count > limits.max_prompts:
        raise APIError(
            f"{field} list length {count} exceeds the maximum allowed count of "
            f"{limits.max_prompts} (--max-prompts-per-request)",
            param=field,
        )


def check_fan_out(num_prompts: int, n: int, limits: RequestLimits) -> None:
    """Sequences one request makes the engine run: every prompt, n times."""
    if n > limits.max_sequences:
        raise APIError(
            f"n must be at most {limits.max_sequences} (--max-sequences-per-request), got {n}",
            param="n",
        )
    if num_prompts * n > limits.max_sequences:
        raise APIError(
            f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences; at most "
            f"{limits.max_sequences} per request are allowed (--max-sequences-per-request)",
            param="n",
        )


def check_stop_strings(stop: list[str], limits: RequestLimits, field: str = "stop") -> None:
    if len(stop) > limits.max_stop_strings:
        raise APIError(
            f"{field} has {len(stop)} strings; at most {limits.max_stop_strings} are allowed "
            f"(--max-stop-strings)",
            param=field,
        )
    for s in stop:
        if len(s) > limits.max_stop_chars:
            raise APIError(
                f"{field} holds a string of {len(s)} characters; at most "
                f"{limits.max_stop_chars} per string are allowed (--max-stop-string-length)",
                param=field,
            )


def check_message_count(count: int, limits: RequestLimits, field: str = "messages") -> None:
    if count > limits.max_messages:
        raise APIError(
            f"{field} has {count} entries; at most {limits.max_messages} are allowed "
            f"(--max-chat-messages)",
            param=field,
        )
