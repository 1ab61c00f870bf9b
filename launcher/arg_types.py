"""The value types of `zserve serve`'s flags: each parses one argument or says why
not (argparse shows the message)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

from engine_core.config import ProfilerConfig
from protocol.messages import LoraModule

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """`2GiB`, `512MiB`, `1G`, `1000000` → bytes (binary for *iB, decimal otherwise)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1G)")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit.endswith("ib"):
        value = number * 1024 ** ("kmgt".index(unit[0]) + 1)
    else:
        value = number * _UNITS[unit.rstrip("b") or ""]
    return int(value)


def str_list(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({e})") from None
        return [str(v) for v in value]
    return [v.strip() for v in text.split(",") if v.strip()]


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A share in (0, 1]: --gpu-memory-utilization."""
    value = float(text)
    if not 0 < value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def logprob_limit(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (the whole vocabulary) or >= 0, got {value}")
    return value


def open_paths(text: str) -> list[str]:
    """--api-key-open-paths: checked against the route table at start-up."""
    from frontend.app import api_key_open_paths

    paths = str_list(text)
    try:
        api_key_open_paths(paths)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return paths


_METRIC_PREFIX = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def metrics_prefix(text: str) -> str:
    if not _METRIC_PREFIX.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot start a Prometheus metric name (letters, digits, _)"
        )
    return text


def cpu_list(text: str) -> list[int]:
    """`0-3,6` → [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 1 or 2-3,6)") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 1 or 2-3,6)")
    return sorted(set(cpus))


# vLLM's profiler fields zserve accepts only at their default value (no effect here).
_PROFILER_DEFAULTS_ONLY = {
    "torch_profiler_dump_cuda_time_total": True,
    "capture_torch_profiler": False,
    "detailed_trace_annotation": False,
    "delay_iterations": 0,
    "max_iterations": 0,
    "warmup_iterations": 0,
    "active_iterations": 5,
    "wait_iterations": 0,
}


def profiler_config(text: str) -> ProfilerConfig:
    """--profiler-config's JSON → ProfilerConfig, every field checked."""
    import json

    try:
        raw = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    raw = dict(raw)
    raw.pop("ignore_frontend", None)  # the API servers never profile: always true here
    for name, default in _PROFILER_DEFAULTS_ONLY.items():
        if name in raw and raw.pop(name) != default:
            raise argparse.ArgumentTypeError(f"{name} is not supported by zserve")
    known = {f.name: f for f in dataclasses.fields(ProfilerConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fields {unknown}; known: {sorted(known)}")
    if raw.get("profiler", "torch") != "torch":
        raise argparse.ArgumentTypeError(
            f"profiler {raw['profiler']!r} is not supported: zserve runs torch's profiler"
        )
    directory = raw.get("torch_profiler_dir")
    if not isinstance(directory, str) or not directory:
        raise argparse.ArgumentTypeError("torch_profiler_dir must be set (a folder)")
    raw["torch_profiler_dir"] = os.path.abspath(os.path.expanduser(directory))
    for name, value in raw.items():
        if name.startswith("torch_profiler_with") or name.endswith(("_shapes", "_gzip")):
            if not isinstance(value, bool):
                raise argparse.ArgumentTypeError(f"{name} must be true or false")
    return ProfilerConfig(**raw)


def json_object(text: str) -> dict:
    """'{"temperature": 0.5}' → a dict."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def resource_map(text: str) -> dict[str, float]:
    """'{"zs": 1, "accelerator_type:A100": 0.01}' → Ray custom resources per engine."""
    value = json_object(text)
    if not all(
        isinstance(k, str) and k and isinstance(v, (int, float)) and v >= 0
        for k, v in value.items()
    ):
        raise argparse.ArgumentTypeError(
            f"not a JSON object of resource names to amounts >= 0: {text!r}"
        )
    if {"CPU", "GPU"} & set(value):
        raise argparse.ArgumentTypeError(
            "CPU and GPU are set by --cpu-threads and --device, not --ray-engine-resources"
        )
    return {k: float(v) for k, v in value.items()}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def lora_module(text: str) -> LoraModule:
    """One --lora-modules item: NAME=PATH, or JSON {"name", "path", "base_model_name"}
    (vLLM's two forms)."""
    text = text.strip()
    if "=" in text and not text.startswith("{"):
        name, _, path = text.partition("=")
        return LoraModule(name.strip(), path.strip())
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not NAME=PATH or a JSON object: {text!r} (e.g. sql=/adapters/sql or "
            '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\')'
        ) from None
    fields = {"name", "path", "base_model_name"}
    if not isinstance(value, dict) or not {"name", "path"} <= set(value) or set(value) - fields:
        raise argparse.ArgumentTypeError(
            f"a JSON --lora-modules item needs name and path (and may have base_model_name): {text!r}"
        )
    if not all(isinstance(v, str) for v in value.values() if v is not None):
        raise argparse.ArgumentTypeError(f"--lora-modules fields must be strings: {text!r}")
    return LoraModule(value["name"], value["path"], value.get("base_model_name"))
