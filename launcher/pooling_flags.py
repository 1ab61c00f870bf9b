"""--runner pooling: serve embeddings or classifications, not generations (vLLM's
flags and their meaning).

A decoder model is turned into an embedding model as vLLM's `--convert embed` does: a
prompt's final hidden states pooled (LAST by default, or what the model's
sentence-transformers files say, or --pooler-config) and normalized. A
*ForSequenceClassification checkpoint (or `--convert classify`) is a classifier: the
pooled state through its score head (launcher/classifier_config.py).
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
from launcher.classifier_config import check_score_head, classifier_settings, is_classifier

log = logging.getLogger("zserve.supervisor")

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# --pooler-config keys vLLM has that change what zserve would answer: refused, named.
_UNSUPPORTED_KEYS = {
    "tok_pooling_type": "token-wise pooling (ALL, STEP) is not served",
    "enable_chunked_processing": "inputs longer than the context are refused, never chunked",
    "max_embed_len": "inputs longer than the context are refused, never chunked",
    "logit_mean": "score calibration is not served",
    "logit_sigma": "score calibration is not served",
    "step_tag_id": "only embeddings are served, not reward scores",
    "returned_token_ids": "only embeddings are served, not reward scores",
}
_ST_POOLING = ("sentence_transformers.models.Pooling", ".modules.pooling.Pooling")
_ST_NORMALIZE = ("sentence_transformers.models.Normalize", ".normalize.Normalize")
_ST_DENSE = ("sentence_transformers.models.Dense", ".dense.Dense")


def add_pooling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "pooling", "serve embeddings or classifications instead of generations"
    )
    g.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="generate (what auto means, unless --convert is set or the model is a "
        "*ForSequenceClassification) or pooling: answer /v1/embeddings (or /classify), "
        "/pooling, /score and /rerank with the model's pooled hidden states instead of "
        "the generation routes",
    )
    g.add_argument(
        "--convert",
        default="auto",
        help="how a causal LM becomes a pooling model: embed (what auto means with "
        "--runner pooling, unless the model is a *ForSequenceClassification) or "
        "classify (its score head, or --hf-overrides' classifier_from_token); other "
        "vLLM values are refused",
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
    if convert not in ("auto", "none", "embed", "classify"):
        return f"--convert {convert} is not supported: zserve converts to embed or classify"
    if convert in ("embed", "classify") and runner == "generate":
        return f"--convert {convert} makes a pooling model: use it with --runner pooling (or auto)"
    return None  # the rest depends on the model (pooling_task)


def pooling_task(args: argparse.Namespace, config: dict) -> str | None:
    """embed, classify, or None (the server generates), for these flags and the
    model's config.json (--hf-overrides applied)."""
    classifier = is_classifier(config)
    if args.runner == "generate" and classifier:
        raise ValueError(
            f"{config['architectures'][0]} has a score head, not an LM head: serve it "
            "with --runner pooling (what auto does)"
        )
    if args.convert in ("embed", "classify"):
        return args.convert
    if args.runner == "pooling" or (args.runner == "auto" and classifier):
        if args.convert == "none" and not classifier:
            raise ValueError(
                "--convert none: a causal LM has no pooler of its own; use --convert embed "
                "(what --runner pooling does by default)"
            )
        return "classify" if classifier else "embed"
    if args.pooler_config is not None:
        raise ValueError("--pooler-config needs --runner pooling")
    return None


def apply_pooling(
    args: argparse.Namespace, engine: EngineConfig, frontend: FrontendConfig | None
) -> EngineConfig:
    """With --runner pooling, the engines' pooler and the API servers' defaults (in
    `frontend`, set here); raises ValueError naming what is wrong."""
    path = Path(engine.model) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}  # the engine says why
    config |= engine.hf_overrides or {}
    task = pooling_task(args, config)
    if task is None:
        return engine
    user = args.pooler_config or {}
    pooling_type, use_activation = pooler_settings(user, Path(engine.model), task)
    classifier = classifier_settings(config) if task == "classify" else None
    if classifier is not None:
        check_score_head(Path(engine.model), classifier)
    log.info(
        "pooling runner (%s): %s pooling, use_activation %s", task, pooling_type, use_activation
    )
    if frontend is not None:
        dims = config.get("matryoshka_dimensions")
        frontend.pooling = PoolingOptions(
            pooling_type=pooling_type,
            normalize=use_activation,
            matryoshka=task == "embed" and (bool(dims) or bool(config.get("is_matryoshka"))),
            matryoshka_dimensions=list(dims) if dims else None,
            task=task,
            labels=classifier.labels if classifier else None,
            use_sep_token=classifier.use_sep_token if classifier else True,
            task_instructions=task_instructions(config, Path(engine.model))
            if task == "embed"
            else None,
        )
    return dataclasses.replace(
        engine,
        runner="pooling",
        pooling_type=pooling_type,
        classifier=classifier.engine if classifier else None,
    )


def pooler_settings(user: dict, model_dir: Path, task: str = "embed") -> tuple[str, bool]:
    """The pooler and whether answers are activated (embeddings normalized) by default:
    --pooler-config's keys, then the model's sentence-transformers files, then LAST and
    activated (vLLM's order)."""
    if "normalize" in user:
        raise ValueError(
            "--pooler-config: Parameter `normalize` was removed; use `use_activation` instead."
        )
    for key in user:
        if key in _UNSUPPORTED_KEYS:
            raise ValueError(f"--pooler-config: {key} is not supported: {_UNSUPPORTED_KEYS[key]}")
        if key not in ("pooling_type", "seq_pooling_type", "use_activation", "task"):
            raise ValueError(f"--pooler-config: unknown key {key!r}")
    if user.get("task", task) != task:
        raise ValueError(
            f"--pooler-config: task {user['task']!r} is not served; this model's is {task}"
        )
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
    default = found.get("normalize", True) if task == "embed" else True
    normalize = user.get("use_activation", default)
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


def task_instructions(config: dict, model_dir: Path) -> dict[str, str] | None:
    """The prompt for each of /v2/embed's input types: config.json's task_instructions,
    else config_sentence_transformers.json's prompts (vLLM's order)."""
    found = config.get("task_instructions")
    if not isinstance(found, dict) or not found:
        path = model_dir / "config_sentence_transformers.json"
        found = json.loads(path.read_text()).get("prompts") if path.is_file() else None
    if not isinstance(found, dict) or not found:
        return None
    return {k: v for k, v in found.items() if isinstance(v, str)} or None
