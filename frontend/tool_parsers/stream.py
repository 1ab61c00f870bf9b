"""Streaming one choice through a tool parser: scans in, OpenAI deltas out."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from frontend.chat_deltas import DeltaMessage, DeltaToolCall
from frontend.tool_parsers.base import CallScan, Scan, ToolParser, segment_content

log = logging.getLogger("zserve.tools")

# While a call is open, rescan only after the text grew by 1/_RESCAN_DIVISOR of the call's
# length: each scan reads the whole call, so this keeps a long call's total cost linear.
_RESCAN_DIVISOR = 16
_NEVER = float("inf")


@dataclass(slots=True)
class _SentCall:
    id: str
    arguments: str = ""
    broken: bool = False  # nothing more goes out for this call


class ToolStreamState:
    """Per-choice state: `feed` each text delta, then `finish` once when generation ends.

    Content goes out as soon as it cannot be the start of a call; a call goes out as a first
    piece with id and name once the name is complete, then as argument fragments. Output that
    turns out malformed before its call was announced goes out as content at `finish`; once a
    call is announced it cannot be taken back, so a call that breaks later just stops.
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._parts: list[str] = []
        self._length = 0
        self._sent_content: list[int] = []  # characters sent of each segment's content
        self._calls: list[_SentCall] = []
        self._stopped = False  # nothing more will go out
        self._next_scan = 0  # the text length that triggers the next scan

    @property
    def calls_sent(self) -> int:
        """How many calls were announced (for `finish_reason`)."""
        return len(self._calls)

    def feed(self, delta: str) -> list[DeltaMessage]:
        """Hot path: one call per engine output."""
        if not delta or self._stopped:
            return []
        self._parts.append(delta)
        self._length += len(delta)
        if self._length < self._next_scan:
            return []
        return self._advance(final=False)

    def finish(self) -> list[DeltaMessage]:
        """The rest, once no more text will come."""
        if self._stopped:
            return []
        out = self._advance(final=False)
        return out + self._advance(final=True)

    def _text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _advance(self, final: bool) -> list[DeltaMessage]:
        text = self._text()
        try:
            scan = self.parser.scan(text, final)
        except Exception:  # a parser bug must never fail the stream
            log.exception("tool parser %s failed while streaming", self.parser.name)
            self._stopped = True
            return []
        out: list[DeltaMessage] = []
        for i, call in enumerate(scan.calls):
            self._emit_content(scan, i, final, out)
            if i == self.parser.keep_calls:
                break  # parallel_tool_calls=false: the rest is not read
            if not self._emit_call(i, call, text, final, out):
                break
        else:
            self._emit_content(scan, len(scan.calls), final, out)
        if self._next_scan != _NEVER:
            self._schedule(scan)
        return out

    def _emit_content(self, scan: Scan, i: int, final: bool, out: list[DeltaMessage]) -> None:
        content = segment_content(scan.segments, i, final)
        while len(self._sent_content) <= i:
            self._sent_content.append(0)
        sent = self._sent_content[i]
        if len(content) > sent:
            out.append(DeltaMessage(content=content[sent:]))
            self._sent_content[i] = len(content)

    def _emit_call(
        self, i: int, call: CallScan, text: str, final: bool, out: list[DeltaMessage]
    ) -> bool:
        """Send what is new of call `i`; True when the call is done and later text may go."""
        parser = self.parser
        first = i == len(self._calls)
        if first:
            unusable = call.error or i >= parser.limits.max_calls
            if final and (unusable or not call.complete or not call.name):
                # Never announced: the malformed rest of the message is plain text.
                if call.start < len(text):
                    out.append(DeltaMessage(content=text[call.start :]))
                self._stopped = True
                return False
            if unusable:
                self._next_scan = _NEVER  # only `finish` can say more: stop scanning
                return False
            if call.name is None or len(call.name) > parser.limits.max_name_chars:
                return False
            self._calls.append(_SentCall(parser.new_call_id()))
        sent = self._calls[i]
        if sent.broken:
            return False
        args = call.arguments
        if len(args) > parser.limits.max_argument_chars or not args.startswith(sent.arguments):
            if not args.startswith(sent.arguments):
                log.warning("tool parser %s took back streamed arguments", parser.name)
            sent.broken = True
            return False
        piece = args[len(sent.arguments) :]
        if first or piece:
            name = call.name if first else None
            out.append(
                DeltaMessage(tool_call=DeltaToolCall(i, piece, sent.id if first else None, name))
            )
            sent.arguments = args
        if call.error:
            sent.broken = True
            return False
        return call.complete

    def _schedule(self, scan: Scan) -> None:
        last = scan.calls[-1] if scan.calls else None
        if last is not None and not last.complete and last.error is None:
            self._next_scan = self._length + (self._length - last.start) // _RESCAN_DIVISOR
        else:
            self._next_scan = 0
