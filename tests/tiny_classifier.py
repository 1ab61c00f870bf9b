"""Sequence-classification checkpoints made offline from a tiny causal LM: its decoder
and a seeded score head (transformers' *ForSequenceClassification, saved as is)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, processors
from transformers import AutoModelForSequenceClassification

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_classifier(
    base: Path, out: Path, labels: list[str], seed: int = 0, separator: str | None = None, **config
) -> Path:
    """`base`'s decoder with a score head over len(labels) labels (`config`: more
    config.json fields, e.g. problem_type). With `separator`, the tokenizer joins a
    pair of texts with that special token between them, as a cross-encoder's does."""
    id2label = dict(enumerate(labels))
    model = AutoModelForSequenceClassification.from_pretrained(
        base,
        num_labels=len(labels),
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
        **config,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # logits of a few units, so that labels differ clearly
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=generator) * 0.3)
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    if separator is not None:
        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A",
            pair=f"$A:0 {separator}:0 $B:1",
            special_tokens=[(separator, tokenizer.token_to_id(separator))],
        )
        tokenizer.save(str(out / "tokenizer.json"))
    return out


def reference_classifier(model_dir: Path | str):
    """transformers' own classifier, fp32, eager attention (hf_generate's reasons)."""
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
