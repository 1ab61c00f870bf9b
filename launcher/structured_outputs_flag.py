"""`--structured-outputs-config`: vLLM's keys (and a few of zserve's), as JSON
(`'{"backend": "xgrammar"}'`) or `key=value,key=value`; every value is checked as the
flag is parsed, and the plan splits it into the engines' and the API servers' parts."""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine_core.config import GrammarConfig
from frontend.structured_outputs import StructuredOutputOptions

# vLLM's other backends; naming one is a clear start-up error, not a silent swap.
_OTHER_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise argparse.ArgumentTypeError(f"{key} must be true or false, got {value!r}")


def _count(key: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"{key} must be a whole number >= 1, got {value!r}")
    return number


def _seconds(key: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = 0.0
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{key} must be a number of seconds > 0, got {value!r}")
    return number


def _backend(key: str, value: Any) -> str:
    if value in ("auto", "xgrammar"):
        return value
    if value in _OTHER_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"backend {value!r} is not available in zserve; use xgrammar (the default)"
        )
    raise argparse.ArgumentTypeError(f"backend must be auto or xgrammar, got {value!r}")


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise argparse.ArgumentTypeError(f"{key} must be a string, got {value!r}")
    return value


_KEYS = {
    "backend": _backend,
    "disable_any_whitespace": _bool,
    "disable_additional_properties": _bool,  # xgrammar is strict already: no effect
    "disable_fallback": _bool,  # one backend: nothing to fall back to
    "enable_in_reasoning": _bool,
    "reasoning_parser": _text,  # as --reasoning-parser
    "compile_threads": _count,
    "compile_timeout_s": _seconds,
    "cache_size": _count,
    "max_spec_bytes": _count,
    "max_choices": _count,
}


def parse_structured_outputs_config(text: str) -> dict[str, Any]:
    """The flag's value → checked settings (argparse reports a bad one with the flag)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        if not isinstance(raw, dict):
            raise argparse.ArgumentTypeError("must be a JSON object or key=value pairs")
    else:
        raw = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"expected key=value, got {part!r}")
            raw[key.strip()] = value.strip()
    settings = {}
    for key, value in raw.items():
        check = _KEYS.get(key)
        if check is None:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r}; the keys are {', '.join(sorted(_KEYS))}"
            )
        settings[key] = check(key, value)
    return settings


def grammar_config(settings: dict[str, Any]) -> GrammarConfig:
    """The engines' part."""
    keys = ("disable_any_whitespace", "compile_threads", "compile_timeout_s", "cache_size")
    return GrammarConfig(
        backend="xgrammar",
        max_spec_bytes=settings.get("max_spec_bytes", GrammarConfig.max_spec_bytes),
        **{k: settings[k] for k in keys if k in settings},
    )


def frontend_options(settings: dict[str, Any]) -> StructuredOutputOptions:
    """The API servers' part."""
    keys = ("max_spec_bytes", "max_choices", "enable_in_reasoning")
    return StructuredOutputOptions(**{k: settings[k] for k in keys if k in settings})
