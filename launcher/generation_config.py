"""--generation-config and --override-generation-config: the server's sampling defaults,
derived as vLLM derives them.

- `auto` (the default): the model folder's generation_config.json;
- `vllm`: none of the model's, only what the override gives;
- a folder: that folder's generation_config.json.

Of the file only the values that differ from transformers' own defaults count (vLLM
reads it through `GenerationConfig.to_diff_dict()`, so a file's `top_k: 50` changes
nothing); the override's values always count. A value of the wrong type or range stops
the start, except in the model's own file (`auto`), where it is logged and left out. A request's own value wins over a
default. `max_new_tokens` becomes the default `max_tokens`, and a ceiling on every
request's: from the override with `auto` or `vllm`, from the folder's file (and the
override) with a folder, as in vLLM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("zserve.supervisor")

FILE = "generation_config.json"
# The request fields a generation config may default, with the type each must have.
_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_INTS = ("top_k", "max_new_tokens")
# The ranges a request's field has (frontend/openai_models.py), as (low, high, text).
_RANGES = {
    "temperature": (0.0, None, ">= 0"),
    "top_p": (1e-9, 1.0, "in (0, 1]"),
    "min_p": (0.0, 1.0, "in [0, 1]"),
    "repetition_penalty": (1e-9, None, "> 0"),
    "presence_penalty": (-2.0, 2.0, "in [-2, 2]"),
    "frequency_penalty": (-2.0, 2.0, "in [-2, 2]"),
    "top_k": (-1, None, ">= -1 (-1 or 0: off)"),
    "max_new_tokens": (1, None, ">= 1"),
}
# transformers' GenerationConfig() values: a file value equal to one is not a default.
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


class GenerationConfigError(ValueError):
    """A flag's value or the file it names cannot give defaults; the message says why."""


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict = field(default_factory=dict)  # field → default (max_tokens included)
    max_tokens_ceiling: int | None = None


def generation_defaults(source: str, model_dir: str, override: dict) -> GenerationDefaults:
    """The defaults of `--generation-config source` for the model in `model_dir`, with
    `--override-generation-config override` applied; raises GenerationConfigError."""
    if source == "vllm":
        from_file = {}
    elif source == "auto":
        from_file = _read(Path(model_dir) / FILE, required=False)
    else:
        folder = Path(source)
        if not folder.is_dir():
            raise GenerationConfigError(f"--generation-config: {source} is not a folder")
        from_file = _read(folder / FILE, required=True)
    from_file = {
        k: v
        for k, v in from_file.items()
        if k not in _TRANSFORMERS_DEFAULTS or v != _TRANSFORMERS_DEFAULTS[k]
    }
    merged = {**from_file, **override}
    sampling = {}
    for key in (*_FLOATS, *_INTS):
        value = merged.get(key)
        if value is None:
            continue
        where = "--override-generation-config" if key in override else f"{FILE} ({source})"
        try:
            sampling[key] = _checked(key, value, where)
        except GenerationConfigError as e:
            if key in override or source != "auto":
                raise  # the operator's own value
            # A model's file is not the operator's: serve the model without that default.
            log.warning("%s; not used as a default", e)
    if "max_new_tokens" in sampling:
        sampling["max_tokens"] = sampling.pop("max_new_tokens")
    if source in ("auto", "vllm"):
        ceiling = sampling["max_tokens"] if "max_new_tokens" in override else None
    else:
        ceiling = sampling.get("max_tokens")
    if sampling:
        log.info(
            "sampling defaults from %s: %s (a request's own values win; "
            "--generation-config vllm drops the model's)",
            {"auto": f"the model's {FILE}", "vllm": "--override-generation-config"}.get(
                source, f"{source}/{FILE}"
            ),
            json.dumps(sampling, sort_keys=True),
        )
    return GenerationDefaults(sampling, ceiling)


def _read(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise GenerationConfigError(f"--generation-config: no {FILE} in {path.parent}")
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(value, dict):
        raise GenerationConfigError(f"{path}: must hold a JSON object")
    return value


def _checked(key: str, value: object, where: str) -> float | int:
    kind = "an integer" if key in _INTS else "a number"
    if isinstance(value, bool) or not isinstance(value, int if key in _INTS else int | float):
        raise GenerationConfigError(f"{where}: {key} must be {kind}, got {value!r}")
    low, high, text = _RANGES[key]
    if value < low or (high is not None and value > high):
        raise GenerationConfigError(f"{where}: {key} must be {text}, got {value}")
    return value if key in _INTS else float(value)
