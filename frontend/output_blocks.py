"""A streamed output as a run of blocks, for the APIs whose streams open and close one
block at a time: the Responses API's output items, Anthropic's content blocks.

The chat output parsers hand over pieces (chat_deltas.DeltaMessage): reasoning text,
answer text, or a piece of a tool call. Consecutive pieces of one kind fill one block; a
piece of another kind, or a call's first piece, closes the open block and opens the next.
Each API says what opening, a delta and closing send (`open_events`, `delta_events`,
`close_events`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from frontend.chat_deltas import DeltaMessage
from frontend.chat_output import ChatOutputParser, ParsedMessage
from frontend.generation import ChoiceDelta

TEXT, REASONING, TOOL = "text", "reasoning", "tool"


@dataclass
class Block:
    kind: str  # TEXT, REASONING or TOOL
    index: int = 0  # its place in the output
    text: str = ""  # the text so far (a call's arguments)
    id: str = ""  # the API's id of the block, where it has one
    call_id: str = ""  # a call's id
    name: str = ""  # a call's function
    logprobs: list = field(default_factory=list)  # a text block's, where asked for


class BlockStream(ABC):
    def start_blocks(self, parser: ChatOutputParser | None) -> None:
        self.parser = parser
        self.stream_state = parser.stream() if parser is not None else None
        self.open: Block | None = None
        self.closed: list[Block] = []

    def whole_blocks(self, text: str, logprobs: list | None = None) -> list[Block]:
        """A finished output's blocks: its reasoning, its answer (an empty one when there
        is nothing else), and its calls."""
        parsed = self.parser.parse(text) if self.parser else ParsedMessage(content=text)
        blocks = []
        if parsed.reasoning:
            blocks.append(Block(REASONING, text=parsed.reasoning))
        if parsed.content or not (blocks or parsed.tool_calls):
            blocks.append(Block(TEXT, text=parsed.content or "", logprobs=logprobs or []))
        for call in parsed.tool_calls:
            blocks.append(Block(TOOL, text=call.arguments, call_id=call.id, name=call.name))
        return blocks

    def pieces(self, d: ChoiceDelta) -> list[DeltaMessage]:
        """One engine delta through the parsers (the whole text, without them)."""
        if self.stream_state is None:
            return [DeltaMessage(content=d.text)] if d.text else []
        pieces = self.stream_state.feed(d.text)
        if d.finish_reason:
            pieces += self.stream_state.finish()
        return pieces

    def finish_blocks(self) -> list[bytes]:
        """Close the last block; an output with none gets an empty text block."""
        out = self.close_block()
        if not self.closed:
            out += self.append(TEXT, "") + self.close_block()
        return out

    def feed_pieces(self, pieces: list[DeltaMessage]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if piece.reasoning is not None:
                out += self.append(REASONING, piece.reasoning)
            elif piece.tool_call is not None:
                call = piece.tool_call
                if call.id is not None:  # a call's first piece
                    out += self.close_block()
                    out += self._start(Block(TOOL, call_id=call.id, name=call.name or ""))
                if call.arguments:
                    self.open.text += call.arguments
                    out += self.delta_events(self.open, call.arguments)
            elif piece.content:
                out += self.append(TEXT, piece.content)
        return out

    def append(self, kind: str, text: str) -> list[bytes]:
        """`text` into the open block of `kind`, opening one if needed ("" sends a delta
        with nothing new, e.g. to carry held-back logprobs)."""
        out: list[bytes] = []
        if self.open is None or self.open.kind != kind:
            out += self.close_block()
            out += self._start(Block(kind))
        self.open.text += text
        return out + self.delta_events(self.open, text)

    def close_block(self) -> list[bytes]:
        block, self.open = self.open, None
        if block is None:
            return []
        self.closed.append(block)
        return self.close_events(block)

    def _start(self, block: Block) -> list[bytes]:
        block.index = len(self.closed)
        self.open = block
        return self.open_events(block)

    @abstractmethod
    def open_events(self, block: Block) -> list[bytes]: ...

    @abstractmethod
    def delta_events(self, block: Block, text: str) -> list[bytes]: ...

    @abstractmethod
    def close_events(self, block: Block) -> list[bytes]: ...
