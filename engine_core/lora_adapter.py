"""Reading a LoRA adapter in PEFT's format: a folder with adapter_config.json and
adapter_model.safetensors, checked against the base model before anything of it is used.

What an adapter may be: LoRA (PEFT's `peft_type` LORA) on any linear layer of the base's
decoder layers that the backend names as a target (q/k/v/o and gate/up/down on the
native forward), any rank up to `max_lora_rank`, `lora_alpha` scaling (`use_rslora`:
alpha / sqrt(r)). What is refused, with the reason: DoRA, LoRA biases, per-module rank or
alpha patterns, modules_to_save, the PEFT variants that change the arithmetic (QA-LoRA,
activated LoRA, ...), adapters on embeddings or the LM head, pickled weights
(adapter_model.bin is never unpickled), and any shape the base does not have.

The files are read once, into memory, with size limits that follow from the base's
shapes; the digest of exactly those bytes keys the adapter's prefix-cache blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from protocol.messages import check_lora_name, check_lora_path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# A safetensors header is JSON: room for every tensor's entry and metadata.
_HEADER_SLACK = 1 << 20
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LoraError(ValueError):
    """An adapter that cannot be served here; the message says which and why."""


# module path in the causal LM (model.layers.0.self_attn.q_proj) → (in, out) features
LoraTargets = dict[str, tuple[int, int]]


@dataclass
class LoraWeights:
    """One adapter as read: per target module its A [r, in] and its B [out, r] already
    multiplied by the scaling, fp32 on the CPU; backends pack these their own way."""

    name: str
    path: str
    digest: bytes  # of the config and weight files' bytes
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter(name: str, path: str, targets: LoraTargets, max_rank: int) -> LoraWeights:
    """The adapter at `path`, checked against the base's `targets`; LoraError if it is
    not one this server can serve."""
    problem = check_lora_name(name) or check_lora_path(path)
    if problem:
        raise LoraError(problem)
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: {path} is not a folder on this machine")
    config_bytes = _read_regular(folder / CONFIG_FILE, MAX_CONFIG_BYTES, name)
    config = _parse_config(config_bytes, name)
    rank = config["r"]
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    limit = _weights_limit(targets, max_rank)
    if not (folder / WEIGHTS_FILE).exists() and (folder / "adapter_model.bin").exists():
        raise LoraError(
            f"LoRA adapter {name!r}: only {WEIGHTS_FILE} is read (adapter_model.bin is a "
            "pickle, which zserve never loads); save the adapter with safetensors"
        )
    weight_bytes = _read_regular(folder / WEIGHTS_FILE, limit, name)
    try:
        tensors = load_safetensors(weight_bytes)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is not readable: {e}") from None
    modules = _pair_tensors(name, tensors, targets, rank)
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config["use_rslora"] else rank)
    digest = hashlib.blake2b(config_bytes + b"\0" + weight_bytes, digest_size=16).digest()
    scaled = {m: (a.float(), b.float() * scaling) for m, (a, b) in modules.items()}
    return LoraWeights(name, str(folder), digest, rank, scaled)


def _read_regular(file: Path, limit: int, name: str) -> bytes:
    """A regular file's bytes, at most `limit` of them (never a FIFO or device, which
    could block or never end)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise LoraError(
            f"LoRA adapter {name!r}: {file.name} is missing from {file.parent}"
        ) from None
    except OSError as e:
        raise LoraError(f"LoRA adapter {name!r}: cannot open {file}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise LoraError(f"LoRA adapter {name!r}: {file} is not a regular file")
        if info.st_size > limit:
            raise LoraError(
                f"LoRA adapter {name!r}: {file.name} is {info.st_size} bytes, more than an "
                f"adapter of this base model at rank <= --max-lora-rank can be ({limit})"
            )
        data = f.read(limit + 1)
    if len(data) > limit:
        raise LoraError(f"LoRA adapter {name!r}: {file.name} grew while it was read")
    return data


def _parse_config(data: bytes, name: str) -> dict:
    """adapter_config.json's fields that matter, checked; LoraError for what zserve does
    not serve."""
    where = f"LoRA adapter {name!r}: {CONFIG_FILE}"
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise LoraError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{where} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{where}: peft_type {peft_type!r} is not LoRA")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"{where}: r must be a positive integer; got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError(f"{where}: lora_alpha must be a finite number; got {alpha!r}")
    refused = {
        "use_dora": "DoRA adapters",
        "lora_bias": "LoRA biases",
        "fan_in_fan_out": "fan_in_fan_out weights (Conv1D layers)",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layer_replication": "layer_replication",
        "target_parameters": "LoRA on parameters (target_parameters)",
        "trainable_token_indices": "trainable token embeddings",
        "use_qalora": "QA-LoRA adapters",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
        "use_bdlora": "block-diagonal LoRA",
        "arrow_config": "Arrow routing",
        "kasa_config": "KaSA adapters",
        "monteclora_config": "MonteCLoRA adapters",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoraError(f"{where}: {what} are not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoraError(f"{where}: bias {bias!r} is not supported (only 'none')")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraError(f"{where}: use_rslora must be true or false; got {rslora!r}")
    return {"r": r, "lora_alpha": float(alpha), "use_rslora": rslora}


def _weights_limit(targets: LoraTargets, max_rank: int) -> int:
    """The largest adapter_model.safetensors of this base at rank <= max_rank (fp32)."""
    return sum((i + o) * max_rank * 4 for i, o in targets.values()) + _HEADER_SLACK


def _pair_tensors(
    name: str, tensors: dict[str, torch.Tensor], targets: LoraTargets, rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every module's (A, B), each shape checked against the base and the rank."""
    where = f"LoRA adapter {name!r}"
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise LoraError(
                f"{where}: tensor {key!r} is not a LoRA A/B weight of a linear layer "
                "(embedding, LM-head and bias adapters are not supported)"
            )
        module = m["module"]
        if module not in targets:
            raise LoraError(
                f"{where}: the base model has no LoRA target {module!r}{_hint(targets)}"
            )
        if tensor.dtype not in _FLOAT_DTYPES or tensor.dim() != 2:
            raise LoraError(f"{where}: {key} must be a 2-D float tensor")
        halves.setdefault(module, {})[m["ab"]] = tensor
    if not halves:
        raise LoraError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise LoraError(f"{where}: {module} has no lora_{missing} weight")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = targets[module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoraError(
                f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this base model needs ({rank}, {fan_in}) and ({fan_out}, {rank}) at rank {rank}"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"{where}: {module} holds NaN or infinite weights")
        modules[module] = (a, b)
    return modules


def _hint(targets: LoraTargets) -> str:
    kinds = sorted({t.rsplit(".", 1)[-1] for t in targets})
    return f" (targets here: {', '.join(kinds)})" if kinds else ""
