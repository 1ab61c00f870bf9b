"""Reasoning between tags (`<think>…</think>`): split from the answer, whole or streamed.

The reasoning text goes out in the `reasoning` field (vLLM's current name, and OpenAI's
guidance for chat completions; vLLM dropped the older `reasoning_content` from its output).
Where the output starts is known from the prompt: a template that opens the think block
itself (DeepSeek-R1, Qwen3.5, Qwen3 thinking-2507) makes the output begin inside reasoning;
one that closes it (`enable_thinking: false`) makes it all answer; otherwise the model may
open the block itself.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from frontend.chat_deltas import DeltaMessage
from frontend.text_tags import find_first, held_suffix


class Mode(enum.Enum):
    """Where a response starts."""

    REASONING = "reasoning"  # inside the think block
    MAYBE = "maybe"  # the model may open a think block first thing
    CONTENT = "content"  # no reasoning at all


class ReasoningParser:
    """A tag-delimited reasoning format. Built per request (it may read the request's
    `chat_template_kwargs`); `stream(mode)` gives the per-choice state."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # Tags that end reasoning without closing it; they begin the answer (and stay in it).
    implicit_ends: ClassVar[tuple[str, ...]] = ()

    def __init__(self, chat_template_kwargs: dict[str, Any] | None = None):
        self.template_kwargs = chat_template_kwargs or {}

    def default_mode(self) -> Mode:
        """Where output starts when the prompt does not say."""
        return Mode.REASONING

    def mode_after(self, prompt: str) -> Mode:
        """Where output starts, from the rendered prompt's last tag."""
        tail = prompt.rstrip()
        if tail.endswith(self.end_tag):
            return Mode.CONTENT
        if tail.endswith(self.start_tag):
            return Mode.REASONING
        return self.default_mode()

    def split(self, text: str, mode: Mode) -> tuple[str | None, str | None]:
        """A finished output as (reasoning, content); an empty part is None. An output cut
        off inside reasoning is all reasoning."""
        state = self.stream(mode)
        pieces = state.feed(text) + state.finish()
        reasoning = "".join(p.reasoning for p in pieces if p.reasoning is not None)
        content = "".join(p.content for p in pieces if p.content is not None)
        return reasoning or None, content or None

    def stream(self, mode: Mode) -> ReasoningStreamState:
        return ReasoningStreamState(self, mode)


class ReasoningStreamState:
    """Per-choice state: `feed` text deltas, `finish` once. A tag never leaks into either
    field, even when it arrives split across deltas; only undecided text is kept."""

    def __init__(self, parser: ReasoningParser, mode: Mode):
        self._start_tag = parser.start_tag
        self._end_tag = parser.end_tag
        self._ends = (parser.end_tag, *parser.implicit_ends)
        self._mode = mode
        self._phase = Mode.CONTENT if mode is Mode.CONTENT else None  # None: not decided yet
        self._held = ""

    @property
    def reasoning_ended(self) -> bool:
        """True once what follows is answer (also when there was no reasoning)."""
        return self._phase is Mode.CONTENT

    def feed(self, delta: str) -> list[DeltaMessage]:
        """Hot path: one call per engine output."""
        if self._phase is Mode.CONTENT and not self._held:
            return [DeltaMessage(content=delta)] if delta else []
        self._held += delta
        return self._advance(final=False)

    def finish(self) -> list[DeltaMessage]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        if self._phase is None:
            text = self._held.lstrip()
            if text.startswith(self._start_tag):
                self._held = text[len(self._start_tag) :]
                self._phase = Mode.REASONING
            elif not final and self._start_tag.startswith(text):
                return out  # maybe the opening tag: wait
            else:
                self._phase = Mode.REASONING if self._mode is Mode.REASONING else Mode.CONTENT
        if self._phase is Mode.REASONING:
            held = self._held
            at, tag = find_first(held, self._ends)
            if at < 0:
                keep = 0 if final else held_suffix(held, self._ends)
                if len(held) > keep:
                    out.append(DeltaMessage(reasoning=held[: len(held) - keep]))
                self._held = held[len(held) - keep :]
                return out
            if at:
                out.append(DeltaMessage(reasoning=held[:at]))
            self._held = held[at + len(tag) :] if tag == self._end_tag else held[at:]
            self._phase = Mode.CONTENT
        if self._held:
            out.append(DeltaMessage(content=self._held))
            self._held = ""
        return out
