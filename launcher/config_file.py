"""`--config FILE`: vLLM's YAML file of flags, e.g.

    model: /models/llama
    port: 8001
    served-model-name: [llama, default]
    enable-prefix-caching: false
    override-generation-config: {temperature: 0.5}

Each key is a flag's name (dashes or underscores); `true` gives the flag, `false` its
`--no-` form where it has one (else nothing), a list its values, a mapping its JSON.
The file's flags go before the command line's own, so the command line wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# A config file is the operator's, but it is still parsed with a bound.
MAX_CONFIG_BYTES = 1 << 20


class ConfigFileError(ValueError):
    pass


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` (after the subcommand) with `--config FILE` replaced by the file's flags,
    placed after the positional MODEL if the command line gives one, else first."""
    path, rest = _take_config(argv)
    if path is None:
        return argv
    config = _load(path)
    options = parser._option_string_actions
    positional_model = bool(rest) and not rest[0].startswith("-")
    flags: list[str] = []
    model: list[str] = []
    for key, value in config.items():
        if not isinstance(key, str) or not key:
            raise ConfigFileError(f"--config {path}: every key must be a flag's name")
        name = key.replace("_", "-").lstrip("-")
        if name == "config":
            raise ConfigFileError(f"--config {path}: a config file cannot name another")
        if name == "model":
            if not positional_model:
                model = [str(value)]
            continue
        flag = f"--{name}"
        if flag not in options:
            raise ConfigFileError(f"--config {path}: {key!r} is not a flag of this command")
        flags += _tokens(flag, value, options)
    if positional_model:
        return [rest[0], *flags, *rest[1:]]
    return [*model, *flags, *rest]


def _take_config(argv: list[str]) -> tuple[str | None, list[str]]:
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigFileError("--config needs a file")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _load(path: str) -> dict:
    import yaml

    file = Path(path)
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigFileError(f"--config {path}: larger than {MAX_CONFIG_BYTES} bytes")
        config = yaml.safe_load(file.read_text())
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"--config {path}: not YAML ({e})") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigFileError(f"--config {path}: must hold a mapping of flags to values")
    return config


def _tokens(flag: str, value: object, options: dict) -> list[str]:
    if isinstance(value, bool):
        negative = "--no-" + flag[2:]
        if value:
            return [flag]
        return [negative] if negative in options else []
    if value is None:
        return []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        return [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
    return [flag, str(value)]
