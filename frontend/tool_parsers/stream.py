"""Streaming one choice through a tool parser: scans in, OpenAI deltas out."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from frontend.chat_deltas import DeltaMessage, DeltaToolCall
from frontend.text_tags import held_suffix
from frontend.tool_parsers.base import CallScan, Scan, ToolParser, segment_content

log = logging.getLogger("zserve.tools")

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
        # Until a call can have begun, content streams without scans: `_unsent` is the text
        # held back meanwhile (the start of a marker, or leading whitespace).
        self._fast = True
        self._plain = False  # the format ruled calls out: all text is content
        self._unsent = ""

    @property
    def calls_sent(self) -> int:
        """How many calls were announced (for `finish_reason`)."""
        return len(self._calls)

    def feed(self, delta: str) -> list[DeltaMessage]:
        """Hot path: one call per engine output."""
        if not delta or self._stopped:
            return []
        if self._plain:
            return [DeltaMessage(content=delta)]
        self._parts.append(delta)
        self._length += len(delta)
        if self._fast:
            out = self._feed_fast(delta)
            if out is not None:
                return out
        if self._length < self._next_scan:
            return []
        return self._advance(final=False)

    def finish(self) -> list[DeltaMessage]:
        """The rest, once no more text will come."""
        if self._stopped or self._plain:
            return []
        self._fast = False
        out = self._advance(final=False)
        return out + self._advance(final=True)

    def _feed_fast(self, delta: str) -> list[DeltaMessage] | None:
        """Content while no call can have begun; None once one may have (scan from then on).
        Says exactly what a scan would, in time proportional to the delta."""
        markers = self.parser.markers
        if not markers:
            verdict = self.parser.starts_plain(self._text())
            if verdict is None:
                return []
            self._fast = False
            if not verdict:
                return None
            self._plain = True
            return [DeltaMessage(content=self._text())]
        unsent = self._unsent + delta
        if any(marker in unsent for marker in markers):
            self._fast = False
            return None
        ready = len(unsent) - held_suffix(unsent, markers)
        if not self._sent_content and not unsent[:ready].strip():
            self._unsent = unsent  # leading whitespace: a call may follow it
            return []
        self._unsent = unsent[ready:]
        if not ready:
            return []
        self._sent_content = [(self._sent_content or [0])[0] + ready]
        return [DeltaMessage(content=unsent[:ready])]

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
            if not self._emit_call(i, call, scan, text, final, out):
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
        self, i: int, call: CallScan, scan: Scan, text: str, final: bool, out: list[DeltaMessage]
    ) -> bool:
        """Send what is new of call `i`; True when the call is done and later text may go."""
        parser = self.parser
        first = i == len(self._calls)
        if first:
            unusable = call.error or i >= parser.limits.max_calls
            if final and (unusable or not call.complete or not call.name):
                # Never announced: the malformed rest of the message is plain text, with the
                # whitespace before it that was held back as the gap before a call.
                rest = text[call.start :]
                if not self._sent_content[i]:
                    rest = scan.segments[i] + rest
                if rest:
                    out.append(DeltaMessage(content=rest))
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
        if call.error:  # what a broken call reports is no longer reliable
            sent.broken = True
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
        return call.complete

    def _schedule(self, scan: Scan) -> None:
        """Space rescans out once calls appear: each scan reads the whole text, so spacing
        them by a fraction of what they read keeps a long output's total cost linear."""
        last = scan.calls[-1] if scan.calls else None
        if last is None:
            self._next_scan = 0
        elif not last.complete and last.error is None:
            self._next_scan = self._length + (self._length - last.start) // _RESCAN_DIVISOR
        else:
            self._next_scan = self._length + self._length // _RESCAN_DIVISOR
