"""Python literals written by a model, read with `ast` into JSON values. Nothing is evaluated:
only constants, signed numbers, lists, tuples and dicts with string keys are accepted."""

from __future__ import annotations

import ast
from typing import Any

from frontend.tool_parsers.json_args import MAX_DEPTH, Malformed

# Models trained on JSON sometimes write its literals inside Python calls.
_JSON_NAMES = {"true": True, "false": False, "null": None}


def parse_literal(source: str) -> Any:
    """The JSON value of one Python literal expression; Malformed if it is anything else."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise Malformed(f"not a Python literal: {e}") from None
    return literal_value(node)


def literal_value(node: ast.expr, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise Malformed(f"literal nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, bool, int, float)):
            return node.value
        raise Malformed(f"{type(node.value).__name__} values are not JSON")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal_value(node.operand, depth + 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Malformed("a sign before something that is not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal_value(e, depth + 1) for e in node.elts]
    if isinstance(node, ast.Dict):
        result = {}
        for key, value in zip(node.keys, node.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise Malformed("dict keys must be strings")
            result[key.value] = literal_value(value, depth + 1)
        return result
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise Malformed(f"{type(node).__name__} is not a literal")
