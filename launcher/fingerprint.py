"""--fingerprint-mode: the `system_fingerprint` of chat and completion responses, as vLLM
sends it. `full` (the default): "zserve-<version>[-dp<N>]-<hash8>"; `hash`: without the
parallelism; `custom`: --fingerprint-value; `none`: null.

The hash names what decides the outputs: the model (its config, generation config and
weight files' names and sizes), the engine's numerics and limits (dtype, device kind,
max_model_len, block size, prefix caching, seed, model implementation and kernels,
logprobs mode, config overrides), the grammar backend and the LoRA adapters. Two
servers with the same fingerprint answer alike; a restart keeps it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

from engine_core.config import EngineConfig

MODES = ("full", "hash", "custom", "none")
MAX_VALUE_CHARS = 256  # echoed in every response


def add_fingerprint_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--fingerprint-mode",
        choices=MODES,
        default="full",
        help="system_fingerprint of chat and completion responses: full "
        "(zserve-VERSION[-dpN]-HASH8, the hash naming the model and the engine's numerics), "
        "hash (without the parallelism), custom (--fingerprint-value) or none (null)",
    )
    g.add_argument("--fingerprint-value", default=None, help="the fingerprint of mode custom")


def fingerprint_refusal(args: argparse.Namespace) -> str | None:
    value = args.fingerprint_value
    if args.fingerprint_mode == "custom":
        if not value:
            return "--fingerprint-mode custom needs --fingerprint-value"
        if len(value) > MAX_VALUE_CHARS or not value.isprintable():
            return f"--fingerprint-value: at most {MAX_VALUE_CHARS} printable characters"
    elif value is not None:
        return "--fingerprint-value is the fingerprint of --fingerprint-mode custom only"
    return None


def system_fingerprint(
    args: argparse.Namespace, engine: EngineConfig, data_parallel_size: int
) -> str | None:
    mode = args.fingerprint_mode
    if mode == "none":
        return None
    if mode == "custom":
        return args.fingerprint_value
    from frontend.app import VERSION

    parts = [f"zserve-{VERSION}"]
    if mode == "full" and data_parallel_size > 1:
        parts.append(f"dp{data_parallel_size}")
    return "-".join([*parts, _hash8(engine)])


def _hash8(engine: EngineConfig) -> str:
    fields = dataclasses.asdict(engine)
    identity = {
        "model": _model_identity(engine.model),
        "device": str(engine.device).split(":")[0],
        "grammar": fields["grammar"]["backend"],
        "lora": sorted(f"{m.name}={m.path}" for m in engine.lora.modules) if engine.lora else None,
        **{
            k: fields[k]
            for k in (
                "dtype",
                "max_model_len",
                "block_size",
                "enable_prefix_caching",
                "seed",
                "model_impl",
                "cpu_kernels",
                "logprobs_mode",
                "hf_overrides",
            )
        },
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _model_identity(folder: str) -> dict:
    root = Path(folder)
    digests = {}
    for name in ("config.json", "generation_config.json"):
        path = root / name
        if path.is_file():
            digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    weights = sorted((p.name, p.stat().st_size) for p in root.glob("*.safetensors"))
    return {"files": digests, "weights": weights}
