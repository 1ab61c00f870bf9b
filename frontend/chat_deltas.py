"""What chat output parsers hand to the serving layer: tool calls and OpenAI stream deltas.

Plain slotted dataclasses, not pydantic: one is built per streamed piece (hot path).
`to_dict()` gives the exact JSON shape OpenAI sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One complete call: `arguments` is a JSON object serialized as a string."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolCallResult:
    """A finished message split into text and calls; `content` is None when empty."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class DeltaToolCall:
    """One piece of a streamed call. The first piece of each index carries `id` and
    `name` (and the arguments so far, maybe ""); later pieces carry arguments only."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        function: dict = {}
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        out["function"] = function
        return out


@dataclass(slots=True, frozen=True)
class DeltaMessage:
    """One streamed piece of a choice: exactly one field is set."""

    content: str | None = None
    reasoning: str | None = None
    tool_call: DeltaToolCall | None = None

    def to_dict(self) -> dict:
        """The chunk's `delta` object."""
        if self.tool_call is not None:
            return {"tool_calls": [self.tool_call.to_dict()]}
        if self.reasoning is not None:
            return {"reasoning": self.reasoning}
        return {"content": self.content or ""}
