"""Tool calls in chat output: one parser per model format, chosen by `--tool-call-parser`.

Importing the package registers the built-in formats.
"""

from frontend.tool_parsers import hermes, llama3_json, mistral, pythonic, qwen3_xml  # noqa: F401
from frontend.tool_parsers.base import ToolLimits, ToolParser
from frontend.tool_parsers.registry import (
    ToolParserError,
    get_tool_parser,
    load_tool_parser_plugin,
    register_tool_parser,
    tool_parser_names,
)
from frontend.tool_parsers.stream import ToolStreamState

__all__ = [
    "ToolLimits",
    "ToolParser",
    "ToolParserError",
    "ToolStreamState",
    "get_tool_parser",
    "load_tool_parser_plugin",
    "register_tool_parser",
    "tool_parser_names",
]
