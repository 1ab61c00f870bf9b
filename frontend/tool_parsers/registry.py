"""Tool parsers by name (`--tool-call-parser NAME`), and plugin files that add more
(`--tool-parser-plugin PATH`)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from frontend.tool_parsers.base import ToolParser

log = logging.getLogger("zserve.tools")

_PARSERS: dict[str, type[ToolParser]] = {}
P = TypeVar("P", bound=type[ToolParser])


class ToolParserError(ValueError):
    """A start-up problem with --tool-call-parser or --tool-parser-plugin."""


def register_tool_parser(*names: str) -> Callable[[P], P]:
    """Class decorator: make the parser available as each of `names`. A later registration
    of a name replaces the earlier one, so a plugin can override a built-in format."""
    if not names:
        raise TypeError("register_tool_parser needs at least one name")

    def register(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"{cls!r} is not a ToolParser subclass")
        for name in names:
            if name in _PARSERS and _PARSERS[name] is not cls:
                log.warning(
                    "tool parser %r: %s replaces %s",
                    name,
                    cls.__qualname__,
                    _PARSERS[name].__qualname__,
                )
            _PARSERS[name] = cls
        if not cls.name:
            cls.name = names[0]
        return cls

    return register


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for `--tool-call-parser NAME`; a clear error lists the known names."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ToolParserError(
            f"--tool-call-parser: unknown tool parser {name!r}; known parsers: "
            f"{', '.join(tool_parser_names())} (or add one with --tool-parser-plugin)"
        ) from None


def load_tool_parser_plugin(path: str | Path) -> list[str]:
    """Run a Python file that registers parsers with `@register_tool_parser(...)`; returns
    the names it added or replaced. Every API-server process must load it (at start-up)."""
    file = Path(path)
    if not file.is_file():
        raise ToolParserError(f"--tool-parser-plugin: {file} is not a file")
    before = dict(_PARSERS)
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    module_name = f"zserve_tool_parser_plugin_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ToolParserError(f"--tool-parser-plugin: cannot load {file} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        _PARSERS.clear()
        _PARSERS.update(before)
        raise ToolParserError(
            f"--tool-parser-plugin: {file} failed to load: {type(e).__name__}: {e}"
        ) from e
    added = sorted(name for name, cls in _PARSERS.items() if before.get(name) is not cls)
    if not added:
        log.warning("--tool-parser-plugin %s registered no tool parser", file)
    return added
