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
    def start_blocks(self) -> None:
        self.open: Block | None = None
        self.closed: list[Block] = []

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
