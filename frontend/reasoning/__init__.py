"""Reasoning in chat output: split from the answer by `--reasoning-parser`.

Importing the package registers the built-in formats.
"""

from frontend.reasoning import think  # noqa: F401
from frontend.reasoning.base import Mode, ReasoningParser, ReasoningStreamState
from frontend.reasoning.boundary import (
    ReasoningBoundary,
    is_reasoning_end,
    reasoning_boundary,
    reasoning_end_index,
)
from frontend.reasoning.registry import (
    ReasoningParserError,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = [
    "Mode",
    "ReasoningBoundary",
    "ReasoningParser",
    "ReasoningParserError",
    "ReasoningStreamState",
    "get_reasoning_parser",
    "is_reasoning_end",
    "reasoning_boundary",
    "reasoning_end_index",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
