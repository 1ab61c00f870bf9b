"""The correctness oracle of greedy generation: transformers' generate() in fp32, one
prompt at a time, optionally with a PEFT LoRA adapter merged into the weights."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def reference_model(model_dir: Path | str, dtype: torch.dtype = torch.float32, **config):
    """transformers' model on its eager attention, the reference every release keeps
    faithful: some releases' SDPA path drops a model's own score transforms (5.17's
    drops gemma2's softcap, so its greedy tokens are not the model's)."""
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", **config
    ).eval()


def hf_greedy(
    model_dir: Path | str, prompts: list[list[int]], num_new: int, adapter: Path | str | None = None
) -> list[list[int]]:
    """Exactly `num_new` greedy tokens after each prompt (EOS ignored)."""
    model = reference_model(model_dir)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            eos_token_id=None,
            pad_token_id=None,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
