"""--runner pooling: serve embeddings, not generations (vLLM's flags and their meaning).

A decoder model is turned into an embedding model as vLLM's `--convert embed` does: a
prompt's final hidden states pooled (LAST by default, or what the model's
sentence-transformers files say, or --pooler-config) and normalized.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from engine_core.config import EngineConfig
from frontend.config import FrontendConfig, PoolingOptions
from launcher.arg_types import json_object

log = logging.getLogger("zserve.supervisor")

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# --pooler-config keys vLLM has that change what zserve would answer: refused, named.
_UNSUPPORTED_KEYS = {
    "tok_pooling_type": "token-wise pooling (ALL, STEP) is not served",
    "enable_chunked_processing": "inputs longer than the context are refused, never chunked",
    "max_embed_len": "inputs longer than the context are refused, never chunked",
    "logit_mean": "only embeddings are served, not classification",
    "logit_sigma": "only embeddings are served, not classification",
    "step_tag_id": "only embeddings are served, not reward scores",
    "returned_token_ids": "only embeddings are served, not reward scores",
}
_ST_POOLING = ("sentence_transformers.models.Pooling", ".modules.pooling.Pooling")
_ST_NORMALIZE = ("sentence_transformers.models.Normalize", ".normalize.Normalize")
_ST_DENSE = ("sentence_transformers.models.Dense", ".dense.Dense")


def add_pooling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pooling", "serve embeddings instead of generations")
    g.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="generate (what auto means, unless --convert embed) or pooling: answer "
        "/v1/embeddings and /pooling with the model's pooled hidden states instead of "
        "the generation routes",
    )
    g.add_argument(
        "--convert",
        default="auto",
        help="how a causal LM becomes a pooling model: embed (what auto means with "
        "--runner pooling); other vLLM values (classify, ...) are refused",
    )
    g.add_argument(
        "--pooler-config",
        type=json_object,
        default=None,
        help='JSON: {"pooling_type": "LAST"|"MEAN"|"CLS", "use_activation": true|false '
        "(normalize by default)}; unset keys come from the model's sentence-transformers "
        "files (modules.json), then LAST and normalized",
    )


def pooling_refusal(args: argparse.Namespace) -> str | None:
    """Why these flags cannot start zserve; None: they can."""
    convert, runner = args.convert, args.runner
    if convert not in ("auto", "none", "embed"):
        return f"--convert {convert} is not supported: zserve converts to embed only"
    if convert == "embed" and runner == "generate":
        return "--convert embed makes a pooling model: use it with --runner pooling (or auto)"
    if not pools(args):
        if args.pooler_config is not None:
            return "--pooler-config needs --runner pooling"
        return None
    if convert == "none":
        return (
            "--convert none: a causal LM has no pooler of its own; use --convert embed "
            "(what --runner pooling does by default)"
        )
    return None


def pools(args: argparse.Namespace) -> bool:
    return args.runner == "pooling" or (args.runner == "auto" and args.convert == "embed")


def apply_pooling(
    args: argparse.Namespace, engine: EngineConfig, frontend: FrontendConfig | None
) -> EngineConfig:
    """With --runner pooling, the engines' pooler and the API servers' defaults (in
    `frontend`, set here); raises ValueError naming what is wrong."""
    if not pools(args):
        return engine
    pooling_type, normalize = pooler_settings(args.pooler_config or {}, Path(engine.model))
    log.info("pooling runner: %s pooling, normalize %s", pooling_type, normalize)
    if frontend is not None:
        config = json.loads((Path(engine.model) / "config.json").read_text())
        dims = config.get("matryoshka_dimensions")
        frontend.pooling = PoolingOptions(
            pooling_type=pooling_type,
            normalize=normalize,
            matryoshka=bool(dims) or bool(config.get("is_matryoshka")),
            matryoshka_dimensions=list(dims) if dims else None,
        )
    return dataclasses.replace(engine, runner="pooling", pooling_type=pooling_type)


def pooler_settings(user: dict, model_dir: Path) -> tuple[str, bool]:
    """The pooler and whether vectors are normalized by default: --pooler-config's keys,
    then the model's sentence-transformers files, then LAST and normalized (vLLM's
    order)."""
    if "normalize" in user:
        raise ValueError(
            "--pooler-config: Parameter `normalize` was removed; use `use_activation` instead."
        )
    for key in user:
        if key in _UNSUPPORTED_KEYS:
            raise ValueError(f"--pooler-config: {key} is not supported: {_UNSUPPORTED_KEYS[key]}")
        if key not in ("pooling_type", "seq_pooling_type", "use_activation", "task"):
            raise ValueError(f"--pooler-config: unknown key {key!r}")
    if user.get("task", "embed") != "embed":
        raise ValueError(f"--pooler-config: task {user['task']!r} is not served; only embed")
    if "pooling_type" in user and "seq_pooling_type" in user:
        raise ValueError("--pooler-config: Cannot set both `pooling_type` and `seq_pooling_type`")
    found = sentence_transformers_pooling(model_dir)
    pooling_type = user.get("pooling_type", user.get("seq_pooling_type", found.get("type")))
    pooling_type = pooling_type or "LAST"
    if pooling_type not in POOLING_TYPES:
        raise ValueError(
            f"--pooler-config: pooling_type {pooling_type!r} is not supported; use "
            f"{', '.join(POOLING_TYPES)}"
        )
    normalize = user.get("use_activation", found.get("normalize", True))
    if not isinstance(normalize, bool):
        raise ValueError(
            f"--pooler-config: use_activation must be true or false; got {normalize!r}"
        )
    return pooling_type, normalize


def sentence_transformers_pooling(model_dir: Path) -> dict:
    """What a sentence-transformers model folder says: {"type": LAST|MEAN|CLS,
    "normalize": bool}, each where it says so. Raises ValueError for a projection
    (Dense) module, which zserve does not run."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return {}
    modules = json.loads(path.read_text())
    kinds = [m.get("type", "") for m in modules if isinstance(m, dict)]
    if any(k.endswith(_ST_DENSE) for k in kinds):
        raise ValueError(
            "the model's sentence-transformers pipeline has a Dense module, which zserve "
            "does not run: its embeddings would not be the model's"
        )
    found: dict = {"normalize": any(k.endswith(_ST_NORMALIZE) for k in kinds)}
    pooling = next((m for m in modules if m.get("type", "").endswith(_ST_POOLING)), None)
    if pooling is None:
        return found
    config_path = model_dir / pooling.get("path", "") / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    for key, value in config.items():
        if key == "pooling_mode" and isinstance(value, str):
            name = value
        elif key.startswith("pooling_mode_") and value is True:
            name = key.removeprefix("pooling_mode_")
        else:
            continue
        kind = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}.get(name.split("_")[0])
        if kind is None:
            raise ValueError(f"the model's sentence-transformers pooling {name!r} is not supported")
        found["type"] = kind
    return found
