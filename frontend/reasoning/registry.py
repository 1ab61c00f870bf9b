"""Reasoning parsers by name (`--reasoning-parser NAME`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from frontend.reasoning.base import ReasoningParser

_PARSERS: dict[str, type[ReasoningParser]] = {}
P = TypeVar("P", bound=type[ReasoningParser])


class ReasoningParserError(ValueError):
    """A start-up problem with --reasoning-parser."""


def register_reasoning_parser(*names: str) -> Callable[[P], P]:
    """Class decorator: make the parser available as each of `names` (later wins)."""
    if not names:
        raise TypeError("register_reasoning_parser needs at least one name")

    def register(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, ReasoningParser)):
            raise TypeError(f"{cls!r} is not a ReasoningParser subclass")
        for name in names:
            _PARSERS[name] = cls
        if not cls.name:
            cls.name = names[0]
        return cls

    return register


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class for `--reasoning-parser NAME`; a clear error lists the known names."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ReasoningParserError(
            f"--reasoning-parser: unknown reasoning parser {name!r}; known parsers: "
            f"{', '.join(reasoning_parser_names())}"
        ) from None
