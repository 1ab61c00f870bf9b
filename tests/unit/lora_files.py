"""A LoRA adapter folder in PEFT's format, written without PEFT (fast, any shape)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, KV = 16, 8
TARGETS = {
    "model.layers.0.self_attn.q_proj": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.v_proj": (HIDDEN, KV),
    "model.layers.0.mlp.down_proj": (32, HIDDEN),
}


def write_adapter(
    folder: Path,
    config: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    rank: int = 4,
    seed: int = 0,
    targets: dict[str, tuple[int, int]] = TARGETS,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "bias": "none"} | (config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for module, (fan_in, fan_out) in targets.items():
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
