"""One chat choice's output, read through the request's reasoning and tool parsers.

Reasoning is split off first; what remains is the answer, which the tool parser reads for
calls. `ChatOutputParser` is per request; `stream()` gives the state of one choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.chat_deltas import DeltaMessage, ToolCall
from frontend.reasoning.base import Mode, ReasoningParser, ReasoningStreamState
from frontend.tool_parsers.base import ToolParser
from frontend.tool_parsers.stream import ToolStreamState


@dataclass(slots=True)
class ParsedMessage:
    """A finished choice: what goes in the response's `message`."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    """The parsers one request's output goes through; either may be None."""

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        mode: Mode = Mode.CONTENT,
        tools: ToolParser | None = None,
        *,
        include_reasoning: bool = True,
    ):
        self.reasoning = reasoning
        self.mode = mode if reasoning is not None else Mode.CONTENT
        self.tools = tools
        self.include_reasoning = include_reasoning

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.mode)
        if not self.include_reasoning:
            reasoning = None
        if self.tools is None:
            return ParsedMessage(content=content, reasoning=reasoning)
        result = self.tools.extract(content or "")
        if not result.calls:
            return ParsedMessage(content=content, reasoning=reasoning)
        return ParsedMessage(content=result.content, reasoning=reasoning, tool_calls=result.calls)

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class ChatOutputStream:
    """Per-choice streaming state: `feed` each text delta, `finish` once at the end."""

    def __init__(self, parser: ChatOutputParser):
        self._reasoning: ReasoningStreamState | None = None
        if parser.reasoning is not None:
            self._reasoning = parser.reasoning.stream(parser.mode)
        self._tools: ToolStreamState | None = parser.tools.stream() if parser.tools else None
        self._include_reasoning = parser.include_reasoning

    @property
    def tool_calls_sent(self) -> int:
        """How many calls went out (for `finish_reason`)."""
        return self._tools.calls_sent if self._tools is not None else 0

    @property
    def reasoning_ended(self) -> bool:
        return self._reasoning is None or self._reasoning.reasoning_ended

    def feed(self, delta: str) -> list[DeltaMessage]:
        """Hot path: one call per engine output."""
        if self._reasoning is None:
            return self._answer([DeltaMessage(content=delta)] if delta else [], final=False)
        return self._answer(self._reasoning.feed(delta), final=False)

    def finish(self) -> list[DeltaMessage]:
        pieces = self._reasoning.finish() if self._reasoning is not None else []
        return self._answer(pieces, final=True)

    def _answer(self, pieces: list[DeltaMessage], final: bool) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        for piece in pieces:
            if piece.reasoning is not None:
                if self._include_reasoning:
                    out.append(piece)
            elif self._tools is None:
                out.append(piece)
            else:
                out.extend(self._tools.feed(piece.content or ""))
        if final and self._tools is not None:
            out.extend(self._tools.finish())
        return out
