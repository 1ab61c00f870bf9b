"""A sequence-classification model's head, as vLLM reads it from the model's config
(config.json under --hf-overrides): how many labels and their names, the activation,
and for an LLM used as a reranker the tokens whose LM-head rows make the head."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from engine_core.config import ClassifierConfig

# sentence-transformers' cross-encoder activations zserve runs (vLLM loads any in
# torch.nn.modules); Sigmoid and Softmax both mean: softmax over 2+ labels, else sigmoid.
_ST_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "classify",
    "torch.nn.modules.activation.Softmax": "classify",
}


@dataclass
class Classifier:
    engine: ClassifierConfig
    labels: list[str | None]  # each label's name (id2label), by index
    # Score pairs are tokenized as a pair (the tokenizer's separator between them), or
    # as one text (an LLM as reranker, vLLM's default for classifier_from_token).
    use_sep_token: bool


def is_classifier(config: dict) -> bool:
    archs = config.get("architectures") or []
    return bool(archs) and str(archs[0]).endswith("ForSequenceClassification")


def classifier_settings(config: dict) -> Classifier:
    """The head config.json (overrides applied) describes; ValueError naming the key
    for one zserve cannot run."""
    tokens = config.get("classifier_from_token")
    method = config.get("method")
    if config.get("is_original_qwen3_reranker"):
        if not (isinstance(tokens, list) and len(tokens) == 2):
            raise ValueError(
                "is_original_qwen3_reranker needs classifier_from_token: two tokens (no, yes)"
            )
        method = "from_2_way_softmax"
    if tokens is not None:
        if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
            raise ValueError("classifier_from_token must be a list of tokens")
        method = method or "no_post_processing"
        if method not in ("from_2_way_softmax", "no_post_processing"):
            raise ValueError(
                f"method {method!r} is not supported; use from_2_way_softmax or no_post_processing"
            )
        if method == "from_2_way_softmax" and len(tokens) != 2:
            raise ValueError("method from_2_way_softmax needs two classifier_from_token")
    elif method is not None:
        raise ValueError(f"method {method!r} needs classifier_from_token")
    two_way = method == "from_2_way_softmax"
    if tokens is None:
        id2label = config.get("id2label") or {}
        num_labels = int(config.get("num_labels") or len(id2label) or 2)
    else:
        id2label, num_labels = {}, 1 if two_way else len(tokens)
    labels = [id2label.get(str(i), id2label.get(i)) for i in range(num_labels)]
    if tokens is None and not id2label:  # transformers' default names
        labels = [f"LABEL_{i}" for i in range(num_labels)]
    activation = _activation(config, num_labels)
    use_sep = config.get("use_pad_token", config.get("use_sep_token", tokens is None))
    return Classifier(
        engine=ClassifierConfig(
            num_labels=num_labels,
            activation=activation,
            from_tokens=tuple(tokens or ()),
            two_way=two_way,
        ),
        labels=labels,
        use_sep_token=bool(use_sep),
    )


def _activation(config: dict, num_labels: int) -> str:
    """transformers' loss for the problem type, else the cross-encoder's activation,
    else softmax over 2+ labels and sigmoid over one (vLLM's order)."""
    problem = config.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    name = None
    if problem != "single_label_classification":
        name = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
            "sbert_ce_default_activation_function"
        )
    kind = "classify" if name is None else _ST_ACTIVATIONS.get(name)
    if kind is None:
        raise ValueError(
            f"activation_fn {name!r} is not supported; zserve runs "
            + ", ".join(sorted(_ST_ACTIVATIONS))
        )
    if kind == "classify":
        return "softmax" if num_labels >= 2 else "sigmoid"
    return kind


def check_score_head(model_dir: Path, classifier: Classifier) -> None:
    """A head of the checkpoint's own (score.weight) must be there: ValueError if not."""
    if classifier.engine.from_tokens or "score.weight" in _tensor_names(model_dir):
        return
    raise ValueError(
        f"{model_dir}: the checkpoint has no score head (score.weight) to classify with; an "
        "LLM used as a classifier names its label tokens: --hf-overrides '{\"classifier_from_"
        'token": ["no", "yes"], "method": "from_2_way_softmax"}\''
    )


def _tensor_names(model_dir: Path) -> set[str]:
    """The tensors of a safetensors checkpoint, from its index or its files' headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names |= set(json.loads(f.read(size))) - {"__metadata__"}
    return names
