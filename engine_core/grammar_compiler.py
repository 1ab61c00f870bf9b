"""One StructuredOutputs constraint → an xgrammar CompiledGrammar, or a GrammarError
whose message names the request field and the reason, without C++ file names or stacks.

The semantics follow vLLM's xgrammar backend: a JSON schema compiles in xgrammar's
strict mode (no properties the schema does not name, unless it allows them), so
`disable_additional_properties` changes nothing here; `json_object` is the schema
`{"type": "object"}`; `choice` is a grammar of literal alternatives; `grammar` is
GBNF/EBNF unless no line defines a rule with `::=`, then Lark; a structural tag in
the legacy `{"structures", "triggers"}` form is compiled as such.

Beyond what xgrammar checks itself, JSON schemas are refused when they nest deeper
than MAX_JSON_DEPTH (compile time grows with the cube of the depth: 1,000 nested
arrays took 49 s) or use a keyword xgrammar would silently ignore, since the output
could then break the schema the client asked for.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from protocol.messages import StructuredOutputs

MAX_JSON_DEPTH = 64
_MAX_REASON_CHARS = 300

# Keywords xgrammar 0.2 accepts but does not enforce (checked against its matcher).
_IGNORED_KEYWORDS = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
)
# Where a schema holds subschemas: one, a list of them, or a name → subschema map.
_ONE_SCHEMA = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_LIST = ("prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")

# "[22:17:22] /project/cpp/regex_converter.cc:94: " and "Check failed: (...) is false: "
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ")


class GrammarError(ValueError):
    """A constraint that cannot be served; str() is the message for the client."""


def compile_constraint(
    compiler: xgr.GrammarCompiler, spec: StructuredOutputs
) -> xgr.CompiledGrammar:
    """Compile `spec`; GrammarError names the field when it is invalid."""
    field = spec.field
    try:
        return _compile(compiler, spec, field)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise GrammarError(f"{field}: {short_reason(e)}") from None


def _compile(
    compiler: xgr.GrammarCompiler, spec: StructuredOutputs, field: str
) -> xgr.CompiledGrammar:
    kind = spec.kind
    any_whitespace = not spec.disable_any_whitespace
    if kind == "json":
        _check_schema(field, _parse_json(field, "JSON schema", spec.json))
        return compiler.compile_json_schema(spec.json, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        if not spec.choice:
            raise GrammarError(f"{field}: give at least one choice")
        return compiler.compile_grammar(choice_grammar(spec.choice))
    if kind == "grammar":
        if is_lark(spec.grammar):
            return compiler.compile_lark(spec.grammar)
        return compiler.compile_grammar(spec.grammar)
    tag = _parse_json(field, "structural tag", spec.structural_tag)
    if isinstance(tag, dict) and "structures" in tag:  # the legacy form vLLM still takes
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return compiler.compile_structural_tag(items, tag["triggers"])
    return compiler.compile_structural_tag(spec.structural_tag)


def choice_grammar(choices: list[str]) -> str:
    """GBNF whose only sentences are the given strings."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    # Quote, backslash and control characters escaped; everything else stays UTF-8.
    # Control characters as \uXXXX: a \x escape reads on while hex digits follow.
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def is_lark(grammar: str) -> bool:
    """vLLM's rule: a grammar none of whose lines defines a rule with `::=` is Lark."""
    for line in grammar.splitlines():
        line = re.sub(r"(#|//).*$", "", line)
        if "::=" in line:
            return False
    return True


def short_reason(error: BaseException) -> str:
    """The compiler's reason on one line: no log prefix, no source path, no echo."""
    text = str(error).strip()
    if isinstance(error, KeyError):
        text = f"missing field {text}"
    line = text.splitlines()[0] if text else type(error).__name__
    line = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", line))
    # Nested reports repeat the prefix ("Failed to parse JSON: [..] file.cc:36: ...").
    line = re.sub(r"\[[\d:]+\] \S+?\.(?:cc|h):\d+: ", "", line)
    line = _CHECK_PREFIX.sub("", line)
    if len(line) > _MAX_REASON_CHARS:
        line = line[: _MAX_REASON_CHARS - 3] + "..."
    return line


def _parse_json(field: str, what: str, text: str) -> object:
    try:
        return json.loads(text)
    except RecursionError:
        raise GrammarError(f"{field}: the {what} nests too deeply") from None
    except ValueError as e:
        raise GrammarError(f"{field}: the {what} is not valid JSON: {e}") from None


def _check_schema(field: str, schema: object) -> None:
    if _depth(schema) > MAX_JSON_DEPTH:
        raise GrammarError(f"{field}: the JSON schema nests deeper than {MAX_JSON_DEPTH} levels")
    found = _ignored_keyword(schema, "")
    if found:
        keyword, path = found
        raise GrammarError(
            f"{field}: the JSON schema keyword {keyword!r} (at {path or '/'}) is not "
            "supported by the xgrammar backend"
        )


def _depth(value: object) -> int:
    # Iterative: the document is client data, a recursive walk could overflow.
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            items = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in items)
    return deepest


def _ignored_keyword(schema: object, path: str) -> tuple[str, str] | None:
    """The first keyword xgrammar would not enforce, with its JSON pointer; walks
    only schema positions, so a property *named* "not" is fine."""
    if not isinstance(schema, dict):
        return None
    for keyword in _IGNORED_KEYWORDS:
        if keyword in schema:
            return keyword, path
    if len(schema.get("allOf") or ()) > 1:
        return "allOf", path  # only a single-branch allOf is enforced
    if ("pattern" in schema or "format" in schema) and (
        "minLength" in schema or "maxLength" in schema
    ):
        return "minLength/maxLength beside pattern/format", path
    children: list[tuple[object, str]] = []
    for key in _ONE_SCHEMA:
        children.append((schema.get(key), f"{path}/{key}"))
    for key in _SCHEMA_LIST:
        value = schema.get(key)
        if isinstance(value, list):
            children += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(value)]
    for key in _SCHEMA_MAP:
        value = schema.get(key)
        if isinstance(value, dict):
            children += [(sub, f"{path}/{key}/{name}") for name, sub in value.items()]
    for child, child_path in children:
        found = _ignored_keyword(child, child_path)
        if found:
            return found
    return None
