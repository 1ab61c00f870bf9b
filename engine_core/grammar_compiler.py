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
could then break the schema the client asked for. Every constraint goes through
xgrammar's Grammar, printed as EBNF, patched by `utf8_safe` (output that is valid
UTF-8, and JSON strings without raw control characters) and compiled: the detour
costs about what compiling costs anyway (7 ms instead of 6.7 for a typical schema).
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
    compiler: xgr.GrammarCompiler, tokenizer_info: xgr.TokenizerInfo, spec: StructuredOutputs
) -> xgr.CompiledGrammar:
    """Compile `spec`; GrammarError names the field when it is invalid."""
    field = spec.field
    try:
        grammar, has_json = _grammar(spec, field, tokenizer_info)
        return compiler.compile_grammar(utf8_safe(str(grammar), json_strings=has_json))
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise GrammarError(f"{field}: {short_reason(e)}") from None


def _grammar(
    spec: StructuredOutputs, field: str, tokenizer_info: xgr.TokenizerInfo
) -> tuple[xgr.Grammar, bool]:
    """The constraint as an xgrammar Grammar, and whether it holds JSON strings."""
    kind = spec.kind
    any_whitespace = not spec.disable_any_whitespace
    if kind == "json":
        _check_schema(field, _parse_json(field, "JSON schema", spec.json))
        return xgr.Grammar.from_json_schema(spec.json, any_whitespace=any_whitespace), True
    if kind == "json_object":
        schema = '{"type": "object"}'
        return xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace), True
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex), False
    if kind == "choice":
        if not spec.choice:
            raise GrammarError(f"{field}: give at least one choice")
        return xgr.Grammar.from_ebnf(choice_grammar(spec.choice)), False
    if kind == "grammar":
        if is_lark(spec.grammar):
            return xgr.Grammar.from_lark(spec.grammar, tokenizer_info=tokenizer_info), False
        return xgr.Grammar.from_ebnf(spec.grammar), False
    tag = _parse_json(field, "structural tag", spec.structural_tag)
    if isinstance(tag, dict) and "structures" in tag:  # the legacy form vLLM still takes
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, tag["triggers"]), True
    return xgr.Grammar.from_structural_tag(spec.structural_tag), True


def utf8_safe(ebnf: str, json_strings: bool) -> str:
    r"""Patch three xgrammar 0.2 flaws into `ebnf` (as xgrammar prints grammars).

    Its character classes take surrogate code points (U+D800-DFFF), which byte-level
    and byte-fallback vocabularies then spell as invalid UTF-8; every negated class and
    the full range (what `.` becomes) are made to exclude them. A JSON string with
    minLength/maxLength admits raw control characters, which JSON forbids
    (xgrammar#800); with `json_strings` that class excludes them too. And the printer
    writes code points below 256 as `\xHH`, which its parser reads on while hex digits
    follow (`\x01` then `F` comes back as `\x1f`): they become `\u00HH`.
    """
    out = []
    i, n = 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch not in '"[':
            out.append(ch)
            i += 1
            continue
        close = '"' if ch == '"' else "]"
        j = i + 1
        while j < n and ebnf[j] != close:
            j += 2 if ebnf[j] == "\\" else 1
        body = _fixed_width(ebnf[i + 1 : j])
        out.append(f'"{body}"' if ch == '"' else _safe_class(body, json_strings))
        i = j + 1
    return "".join(out)


def _fixed_width(text: str) -> str:
    r"""`\xHH` escapes as `\u00HH`; every other escape kept as written."""
    out = []
    i, n = 0, len(text)
    while i < n:
        if text[i] != "\\":
            out.append(text[i])
            i += 1
        elif text[i + 1 : i + 2] == "x" and _HEX2.fullmatch(text[i + 2 : i + 4]):
            out.append(r"\u00" + text[i + 2 : i + 4])
            i += 4
        else:
            out.append(text[i : i + 2])
            i += 2
    return "".join(out)


_HEX2 = re.compile(r"[0-9a-fA-F]{2}")


_SURROGATES = r"\ud800-\udfff"
_BOUNDED_JSON_CHARS = r"^\"\\\r\n"  # xgrammar's class for a length-bounded string


def _safe_class(body: str, json_strings: bool) -> str:
    if json_strings and body == _BOUNDED_JSON_CHARS:
        body = r"^\0-\u001f\"\\"
    if body.startswith("^"):
        return f"[{body}{_SURROGATES}]"
    if body == r"\0-\U0010ffff":
        return f"[^{_SURROGATES}]"
    return f"[{body}]"


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
