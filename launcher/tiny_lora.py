"""Deterministic random LoRA adapters in PEFT's format for the tiny models
(`zserve make-tiny-model --lora DIR`): the LoRA tests' fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

from launcher.tiny_model import is_occupied, move_into_place, progress_bars_off

# What --lora-targets names, per architecture's module names (PEFT's target_modules).
LORA_TARGETS = {
    "all": "all-linear",
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"],
    "qv": ["q_proj", "v_proj", "qkv_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj", "gate_up_proj"],
}


def build_tiny_lora(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    rank: int = 8,
    alpha: float = 16,
    targets: str = "all",
    use_rslora: bool = False,
    force: bool = False,
) -> Path:
    """Write a random LoRA adapter for the model at `model_dir` with PEFT, in its format
    (adapter_config.json + adapter_model.safetensors), deterministically from `seed`.

    Both A and B are drawn (PEFT's own init leaves B zero: an adapter that changes
    nothing), from N(0, the base's initializer_range), so the adapter moves greedy
    output about as much as the base weights themselves."""
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ValueError(f"--lora needs the peft package (pip install peft): {e}") from None
    if targets not in LORA_TARGETS:
        raise ValueError(
            f"unknown LoRA targets {targets!r}; choose one of {', '.join(LORA_TARGETS)}"
        )
    out = Path(out_dir)
    if not force and is_occupied(out):
        raise FileExistsError(f"{out} already exists; use --force to replace it")
    with torch.random.fork_rng(devices=[]), progress_bars_off(), warnings.catch_warnings():
        # peft asks transformers about gradient checkpointing in a deprecated way.
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        wanted = LORA_TARGETS[targets]
        if isinstance(wanted, list):  # only the names this architecture has
            present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
            wanted = [t for t in wanted if t in present]
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=wanted,
            lora_dropout=0.0,
            bias="none",
            use_rslora=use_rslora,
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(model, config)
        generator = torch.Generator().manual_seed(seed)
        std = getattr(model.config, "initializer_range", 0.02)
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.data.normal_(0.0, std, generator=generator)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        with progress_bars_off():
            peft_model.save_pretrained(staging)
        os.chmod(staging, 0o755)
        move_into_place(staging, out, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
