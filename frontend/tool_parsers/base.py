"""The tool-parser interface: a format reads model text into plain segments and calls.

A format implements one pure function, `scan(text, final)`, describing what the text says so
far. Everything a scan reports must stay true as the text grows (names appear only once
complete, arguments only as a prefix no continuation can change); `ToolStreamState` turns the
difference between two scans into OpenAI deltas, and `extract` reads a finished text. Because
both read the same scans, a well-formed message streamed in any chunking reassembles to
exactly the non-streamed result.
"""

from __future__ import annotations

import logging
import secrets
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from frontend.chat_deltas import ToolCall, ToolCallResult
from frontend.tool_parsers.json_args import Malformed

if TYPE_CHECKING:
    from frontend.tool_parsers.stream import ToolStreamState

log = logging.getLogger("zserve.tools")

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolLimits:
    """Bounds on what one message may hold; output past them is not read as calls."""

    max_calls: int = 64
    max_argument_chars: int = 256 * 1024
    max_name_chars: int = 256


@dataclass(slots=True)
class CallScan:
    """One call as far as the text shows it."""

    start: int  # where the call's text begins in the message (its marker)
    name: str | None = None  # set once complete
    arguments: str = ""  # a prefix of the final arguments string that can no longer change
    complete: bool = False  # the call's text is closed; `arguments` is final
    error: str | None = None  # why this call can never be well formed


@dataclass(slots=True)
class Scan:
    """`segments[i]` is the plain text before `calls[i]`; one more segment follows the last call."""

    segments: list[str] = field(default_factory=lambda: [""])
    calls: list[CallScan] = field(default_factory=list)

    def add_call(self, call: CallScan) -> CallScan:
        self.calls.append(call)
        self.segments.append("")
        return call

    def fail(self, call: CallScan, error: Malformed | str) -> Scan:
        call.error = str(error) or type(error).__name__
        return self


class ToolParser:
    """One tool-call format. Built per request (it may read the request's tools); `stream()`
    gives the per-choice streaming state."""

    name: ClassVar[str] = ""
    # Markers that are special tokens vanish from the text unless the request keeps them.
    keep_special_tokens: ClassVar[bool] = False
    # Text that begins every call. Until one appears, streamed text is content and needs no
    # scan (formats whose calls can only come first use `starts_plain` instead).
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        tools: list[dict[str, Any]] | None = None,
        limits: ToolLimits | None = None,
        *,
        parallel_tool_calls: bool = True,
    ):
        self.tools = tools or []
        self.limits = limits or ToolLimits()
        # parallel_tool_calls=false: the first call counts, later ones are not read at all.
        self.keep_calls = None if parallel_tool_calls else 1

    def scan(self, text: str, final: bool) -> Scan:
        """What `text` says so far. `final` means no more text will come: nothing is held
        back as a possible tag, and unfinished calls are errors."""
        raise NotImplementedError

    def starts_plain(self, head: str) -> bool | None:
        """For formats without `markers`: True when `head`, the start of the text, already
        rules out calls (all of the text is content), False when it may begin one, None
        while undecided."""
        return False

    def open_call(self, scan: Scan, start: int) -> CallScan:
        """Add a call that begins at `start`; past the call limit it is born broken, which
        also stops the scan from reading further."""
        call = scan.add_call(CallScan(start))
        if len(scan.calls) > self.limits.max_calls:
            call.error = f"more than {self.limits.max_calls} tool calls in one message"
        return call

    def new_call_id(self) -> str:
        """OpenAI's form: `call_` and 24 letters or digits."""
        return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))

    def extract(self, text: str) -> ToolCallResult:
        """A finished message: its calls, or all of it as content when any call is malformed."""
        try:
            scan = self.scan(text, final=True)
            problem = self.problem(scan)
        except Exception:  # a parser bug must never fail the request
            log.exception("tool parser %s failed; returning the output as content", self.name)
            return ToolCallResult(content=text, calls=[])
        if not scan.calls:
            return ToolCallResult(content=text, calls=[])
        if problem:
            log.info("tool parser %s: %s; returning the output as content", self.name, problem)
            return ToolCallResult(content=text, calls=[])
        kept = scan.calls[: self.keep_calls]
        calls = [ToolCall(self.new_call_id(), c.name or "", c.arguments) for c in kept]
        content = "".join(segment_content(scan.segments, i, True) for i in range(len(kept) + 1))
        return ToolCallResult(content=content or None, calls=calls)

    def problem(self, scan: Scan) -> str | None:
        """Why a final scan does not hold well-formed calls within the limits, or None."""
        limits = self.limits
        if len(scan.calls[: self.keep_calls]) > limits.max_calls:
            return f"more than {limits.max_calls} tool calls in one message"
        for i, call in enumerate(scan.calls[: self.keep_calls]):
            why = call.error or self.call_problem(call)
            if why:
                return f"tool call {i}: {why}"
        return None

    def call_problem(self, call: CallScan) -> str | None:
        """Why one call is not acceptable as it stands (limits checked while streaming too)."""
        limits = self.limits
        if not call.complete:
            return "unfinished"
        if not call.name:
            return "no function name"
        if len(call.name) > limits.max_name_chars:
            return f"function name longer than {limits.max_name_chars} characters"
        if len(call.arguments) > limits.max_argument_chars:
            return f"arguments longer than {limits.max_argument_chars} characters"
        return None

    def stream(self) -> ToolStreamState:
        from frontend.tool_parsers.stream import ToolStreamState

        return ToolStreamState(self)


def segment_content(segments: list[str], i: int, final: bool) -> str:
    """What segment `i` contributes to the content. Whitespace-only text between or around
    calls is dropped; the last segment, while it is only whitespace and the text may still
    grow, is held back: a call may follow it."""
    seg = segments[i]
    if seg.strip():
        return seg
    if final and i == len(segments) - 1 and len(segments) == 1:
        return seg
    return ""


def mistral_call_id() -> str:
    """Mistral's templates insist on 9 letters or digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))
