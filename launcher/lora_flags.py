"""`--enable-lora` and its flags: the settings every engine gets, and what is wrong with
them before any process starts."""

from __future__ import annotations

import argparse
import os

from protocol.messages import (
    MAX_LORA_ADAPTERS,
    LoraConfig,
    LoraModule,
    check_lora_name,
    check_lora_path,
)

# The highest --max-lora-rank (vLLM's largest choice).
MAX_LORA_RANK = 512


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """--enable-lora's settings, each --lora-modules path made absolute (None: LoRA off)."""
    if not args.enable_lora:
        return None
    modules = [
        LoraModule(m.name, os.path.abspath(os.path.expanduser(m.path)), m.base_model_name)
        for m in args.lora_modules
    ]
    return LoraConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras or args.max_loras,
        modules=modules,
    )


def runtime_lora_updating(args: argparse.Namespace) -> bool:
    """--enable-runtime-lora-updating, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1."""
    env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower()
    return args.enable_runtime_lora_updating or env in ("1", "true")


def refuse_lora(args: argparse.Namespace) -> str | None:
    """What is wrong with the LoRA flags, before any process starts: the names, the
    limits, each folder's two files (the engines read and check the rest)."""
    if not args.enable_lora:
        if args.lora_modules or runtime_lora_updating(args):
            flag = "--lora-modules" if args.lora_modules else "--enable-runtime-lora-updating"
            return f"{flag} needs --enable-lora"
        return None
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        return f"--max-cpu-loras ({args.max_cpu_loras}) must be at least --max-loras ({args.max_loras})"
    if args.max_lora_rank > MAX_LORA_RANK:
        return f"--max-lora-rank {args.max_lora_rank} is above {MAX_LORA_RANK}"
    if len(args.lora_modules) > MAX_LORA_ADAPTERS:
        return (
            f"--lora-modules names {len(args.lora_modules)} adapters; at most {MAX_LORA_ADAPTERS}"
        )
    served = set(args.served_model_name or [args.model or "zserve-default"])
    seen: set[str] = set()
    for m in args.lora_modules:
        problem = check_lora_name(m.name) or check_lora_path(m.path)
        if problem:
            return f"--lora-modules {m.name}: {problem}"
        if m.name in seen or m.name in served:
            what = "a served model name" if m.name in served else "given twice"
            return f"--lora-modules: the adapter name {m.name!r} is {what}"
        seen.add(m.name)
        folder = os.path.expanduser(m.path)
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            if not os.path.isfile(os.path.join(folder, file)):
                return (
                    f"--lora-modules {m.name}: {m.path} has no {file} (a PEFT LoRA adapter folder)"
                )
    return None
