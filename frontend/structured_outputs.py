"""A request's output constraint, from whichever field states it, as the wire's
StructuredOutputs; every refusal is a 400 naming the field and the limit.

The fields, with vLLM's names and meanings (chat and completions alike):
- `response_format`: `json_object`, `json_schema` (`json_schema.schema`), `structural_tag`
  (its `format`, or the legacy `structures` + `triggers`); `text` is no constraint;
- `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`,
  `structural_tag`, plus `disable_any_whitespace` and `disable_additional_properties`;
- the legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them per request. What is checked here is size and shape; whether a schema,
regex or grammar compiles the engine finds out (off its step thread) and answers with the
compiler's reason, which becomes the same kind of 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from frontend.errors import APIError
from frontend.openai_models import SamplingFields
from protocol.messages import StructuredOutputs

# vLLM's `structured_outputs` keys; a backend name is accepted only when it is ours.
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_FLAGS = ("disable_any_whitespace", "disable_additional_properties")
_BACKEND_KEYS = ("backend", "_backend", "disable_fallback")
_OUR_BACKENDS = (None, "", "auto", "xgrammar")
_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class StructuredOutputOptions:
    """Server-wide structured-output settings the API servers need
    (`--structured-outputs-config`)."""

    max_spec_bytes: int = 64 * 1024  # one constraint's text: schema, regex, grammar, choices
    max_choices: int = 1024  # entries of a `choice` list
    enable_in_reasoning: bool = False  # constrain reasoning too (vLLM's key)


def request_constraint(
    body: SamplingFields, options: StructuredOutputOptions
) -> StructuredOutputs | None:
    """The request's constraint, or None; APIError when a field is malformed, too
    large, or a second source of constraint."""
    extra = body.model_extra or {}
    found: list[StructuredOutputs] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        found.append(_from_response_format(response_format))
    if extra.get("structured_outputs") is not None:
        found.append(_from_structured_outputs(extra["structured_outputs"]))
    legacy = [key for key in _LEGACY if extra.get(key) is not None]
    for key in legacy:
        found.append(_constraint(_LEGACY[key], extra[key], key))
    backend = extra.get("guided_decoding_backend")
    if backend not in _OUR_BACKENDS:
        raise APIError(
            f"guided_decoding_backend: {str(backend)[:40]!r} is not available; this server "
            f"compiles constraints with xgrammar",
            param="guided_decoding_backend",
        )
    for key in ("guided_whitespace_pattern", "whitespace_pattern"):
        if extra.get(key) is not None:
            raise APIError(
                f"{key}: not supported by the xgrammar backend; use disable_any_whitespace",
                param=key,
            )
    if len(found) > 1:
        names = ", ".join(s.param.split(".")[0] for s in found)
        raise APIError(
            f"{found[1].param.split('.')[0]}: give one output constraint per request; got {names}",
            param=found[1].param.split(".")[0],
        )
    if not found:
        return None
    check_size(found[0], options)
    return found[0]


def check_size(spec: StructuredOutputs, options: StructuredOutputOptions) -> None:
    """The limits of one constraint: its bytes (the engine's limit too) and choices."""
    if spec.choice is not None and len(spec.choice) > options.max_choices:
        raise APIError(
            f"{spec.param}: {len(spec.choice)} choices; at most {options.max_choices} are allowed",
            param=spec.param,
        )
    texts = [spec.json, spec.regex, spec.grammar, spec.structural_tag, *(spec.choice or ())]
    size = sum(len(t.encode()) for t in texts if t)
    if size > options.max_spec_bytes:
        raise APIError(
            f"{spec.param}: the constraint is {size} bytes; at most {options.max_spec_bytes} "
            f"are allowed (--structured-outputs-config max_spec_bytes)",
            param=spec.param,
        )


def constraint(
    kind: str, value: Any, param: str, options: StructuredOutputOptions
) -> StructuredOutputs:
    """One constraint of `kind` (a StructuredOutputs field: json, regex, choice, grammar,
    json_object, structural_tag) from `value`, within the limits; for other doors (gRPC)."""
    spec = _constraint(kind, value, param)
    check_size(spec, options)
    return spec


def json_schema_constraint(schema: Any, param: str) -> StructuredOutputs:
    """A JSON schema given as an object (or as JSON text) → the `json` constraint."""
    return StructuredOutputs(json=_json_text(schema, param, "a JSON schema"), param=param)


def _from_response_format(response_format: Any) -> StructuredOutputs:
    kind = response_format.type
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = response_format.json_schema
        if not isinstance(spec, dict):
            raise APIError(
                "response_format.json_schema: required for type json_schema",
                param="response_format.json_schema",
            )
        if spec.get("schema") is None:
            raise APIError(
                "response_format.json_schema.schema: required (the JSON schema itself)",
                param="response_format.json_schema.schema",
            )
        return json_schema_constraint(spec["schema"], "response_format.json_schema.schema")
    # structural_tag: vLLM hands the whole object to xgrammar, legacy form or `format`.
    tag = response_format.model_dump(exclude_none=True)
    if "format" not in tag and not ("structures" in tag and "triggers" in tag):
        raise APIError(
            "response_format: a structural_tag needs `format`, or `structures` and `triggers`",
            param="response_format",
        )
    return StructuredOutputs(
        structural_tag=_json_text(tag, "response_format", "a structural tag"),
        param="response_format",
    )


def _from_structured_outputs(value: Any) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise APIError("structured_outputs: must be an object", param="structured_outputs")
    unknown = sorted(set(value) - {*_KINDS, *_FLAGS, *_BACKEND_KEYS, "whitespace_pattern"})
    if unknown:
        raise APIError(
            f"structured_outputs: unknown key {unknown[0][:40]!r}; the keys are "
            f"{', '.join(_KINDS + _FLAGS)}",
            param=f"structured_outputs.{unknown[0][:40]}",
        )
    for key in ("backend", "_backend"):
        if value.get(key) not in _OUR_BACKENDS:
            raise APIError(
                f"structured_outputs.{key}: {str(value[key])[:40]!r} is not available; this "
                f"server compiles constraints with xgrammar",
                param=f"structured_outputs.{key}",
            )
    if value.get("whitespace_pattern") is not None:
        raise APIError(
            "structured_outputs.whitespace_pattern: not supported by the xgrammar backend; "
            "use disable_any_whitespace",
            param="structured_outputs.whitespace_pattern",
        )
    kinds = [k for k in _KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise APIError(
            f"structured_outputs: set exactly one of {', '.join(_KINDS)}; got "
            f"{', '.join(kinds) or 'none'}",
            param="structured_outputs",
        )
    spec = _constraint(kinds[0], value[kinds[0]], f"structured_outputs.{kinds[0]}")
    flags = {}
    for flag in _FLAGS:
        if value.get(flag) is not None:
            if not isinstance(value[flag], bool):
                raise APIError(
                    f"structured_outputs.{flag}: must be true or false",
                    param=f"structured_outputs.{flag}",
                )
            flags[flag] = value[flag]
    return msgspec.structs.replace(spec, **flags) if flags else spec


def _constraint(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json":
        return json_schema_constraint(value, param)
    if kind == "json_object":
        if value is not True:
            raise APIError(f"{param}: must be true", param=param)
        return StructuredOutputs(json_object=True, param=param)
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise APIError(f"{param}: must be a non-empty list of strings", param=param)
        choices = [_text(c, f"{param}[{i}]") for i, c in enumerate(value)]
        return StructuredOutputs(choice=choices, param=param)
    if kind == "structural_tag":
        text = value if isinstance(value, str) else _json_text(value, param, "a structural tag")
        return StructuredOutputs(structural_tag=text, param=param)
    text = _text(value, param)
    if not text:
        raise APIError(f"{param}: may not be empty", param=param)
    return StructuredOutputs(**{kind: text, "param": param})


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise APIError(f"{param}: must be a string", param=param)
    return value


def _json_text(value: Any, param: str, what: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (dict, bool)):
        raise APIError(f"{param}: must be {what} (an object)", param=param)
    try:
        # Key order is kept: it is the order the properties are generated in.
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (RecursionError, ValueError, TypeError):
        raise APIError(f"{param}: {what} that cannot be written as JSON", param=param) from None
