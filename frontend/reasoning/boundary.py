"""Where reasoning ends, in token ids: what structured outputs need to start constraining
after the think block rather than inside it.

The engine sees token ids, not text, so the frontend hands it plain data: whether the output
starts inside reasoning and the ids the end tag encodes to (one id when the tokenizer has the
tag as an added token, as real reasoning models do; several for a byte-level tokenizer).
`is_reasoning_end` and `reasoning_end_index` use nothing but the standard library, so the
engine side can share them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from frontend.reasoning.base import Mode, ReasoningParser


@dataclass(frozen=True)
class ReasoningBoundary:
    """Per request: constrain output only after `end_ids` appear in it when `in_reasoning`."""

    in_reasoning: bool
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]


def reasoning_boundary(
    parser: ReasoningParser, mode: Mode, encode: Callable[[str], list[int]]
) -> ReasoningBoundary:
    """`encode` is the tokenizer without special tokens added. A response that may open a
    think block (Mode.MAYBE) counts as reasoning, as vLLM does: constraining from the first
    token would forbid the `<think>` the model is about to write."""
    return ReasoningBoundary(
        in_reasoning=mode is not Mode.CONTENT,
        start_ids=tuple(encode(parser.start_tag)),
        end_ids=tuple(encode(parser.end_tag)),
    )


def _last_index(ids: Sequence[int], seq: Sequence[int], stop: int) -> int:
    """The start of the last occurrence of `seq` in `ids[:stop]`, or -1."""
    n = len(seq)
    if not n:
        return -1
    first = seq[0]
    for i in range(stop - n, -1, -1):
        if ids[i] == first and list(ids[i : i + n]) == list(seq):
            return i
    return -1


def is_reasoning_end(ids: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int]) -> bool:
    """True when the last tag in `ids` (prompt and output together) is the end tag."""
    end = _last_index(ids, end_ids, len(ids))
    return end >= 0 and _last_index(ids, start_ids, len(ids)) < end


def reasoning_end_index(
    output_ids: Sequence[int], boundary: ReasoningBoundary, start: int = 0
) -> int | None:
    """The index in `output_ids` just past the end tag (where constrained decoding starts),
    searching from `start` (pass the previous length minus len(end_ids) to stay linear);
    0 when the output does not start in reasoning; None while reasoning goes on."""
    if not boundary.in_reasoning:
        return 0
    seq = boundary.end_ids
    n = len(seq)
    if not n:
        return 0
    for i in range(max(0, start), len(output_ids) - n + 1):
        if output_ids[i] == seq[0] and list(output_ids[i : i + n]) == list(seq):
            return i + n
    return None
