"""The correctness oracle of greedy generation: transformers' generate() in fp32, one
prompt at a time, optionally with a PEFT LoRA adapter merged into the weights."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(
    model_dir: Path | str, prompts: list[list[int]], num_new: int, adapter: Path | str | None = None
) -> list[list[int]]:
    """Exactly `num_new` greedy tokens after each prompt (EOS ignored)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
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
