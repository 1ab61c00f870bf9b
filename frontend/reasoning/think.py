"""The `<think>…</think>` formats: `deepseek_r1` and `qwen3`."""

from __future__ import annotations

from frontend.reasoning.base import Mode, ReasoningParser
from frontend.reasoning.registry import register_reasoning_parser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """R1's template opens the think block in the prompt (older checkpoints write `<think>`
    themselves, which is dropped): output is reasoning until `</think>`."""

    def default_mode(self) -> Mode:
        return Mode.REASONING


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 writes `<think>` itself unless its template already did (Qwen3.5, thinking-2507
    checkpoints); `chat_template_kwargs.enable_thinking: false` means no reasoning. A
    `<tool_call>` inside reasoning ends it: Qwen3.5 may call a tool without closing the block."""

    implicit_ends = ("<tool_call>",)

    def default_mode(self) -> Mode:
        if self.template_kwargs.get("enable_thinking") is False:
            return Mode.CONTENT
        return Mode.MAYBE
