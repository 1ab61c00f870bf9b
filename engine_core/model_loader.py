"""Reading a local HF model folder: the architecture allowlist, dtype, EOS ids, the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from engine_core.attention import ATTN_IMPLEMENTATION, register_with_transformers

# Each has a conformance test against transformers' own generate().
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelInfo:
    """What the engine needs to know about a model before and after loading it."""

    path: Path
    architecture: str
    hf_config: PretrainedConfig
    eos_token_ids: frozenset[int]
    vocab_size: int
    max_position_embeddings: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _as_ids(value: object) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset([value])
    return frozenset(int(v) for v in value)


def inspect_model(model_dir: str, overrides: dict | None = None) -> ModelInfo:
    """Read the folder's configs, with `overrides` (--hf-overrides, as vLLM applies them)
    over config.json; refuse any architecture off the allowlist."""
    path = Path(model_dir)
    raw = _read_json(path / "config.json")
    if not raw:
        raise ValueError(f"{model_dir}: no config.json; expected a local Hugging Face model folder")
    raw |= overrides or {}
    archs = raw.get("architectures") or [raw.get("model_type", "<unknown>")]
    # A sequence-classification checkpoint is its causal LM's decoder and a score head
    # (the engine's pooler runs the head: --runner pooling).
    arch = archs[0].replace("ForSequenceClassification", "ForCausalLM")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {archs[0]} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    _override(config, overrides or {})
    generation = _read_json(path / "generation_config.json")
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelInfo(
        path=path,
        architecture=arch,
        hf_config=config,
        eos_token_ids=_as_ids(eos),
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
    )


def _override(config: PretrainedConfig, overrides: dict) -> None:
    """A mapping over a sub-config merges into it; any other value replaces the field."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            _override(current, value)
        else:
            setattr(config, key, value)


def resolve_dtype(requested: str, info: ModelInfo, device: torch.device) -> torch.dtype:
    """auto = the checkpoint's dtype; float16 on CPU becomes bfloat16 (CPU fp16 is slow)."""
    if requested == "auto":
        dtype = info.hf_config.dtype or torch.float32
        if isinstance(dtype, str):
            dtype = _DTYPES.get(dtype, torch.float32)
        if dtype not in _DTYPES.values():
            dtype = torch.float32
    elif requested in _DTYPES:
        dtype = _DTYPES[requested]
    else:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {requested!r}")
    if dtype == torch.float16 and device.type == "cpu":
        dtype = torch.bfloat16
    return dtype


def load_model(info: ModelInfo, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The unmodified HF model, its attention routed to our paged function."""
    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(
        info.path,
        config=info.hf_config,
        dtype=dtype,
        attn_implementation=ATTN_IMPLEMENTATION,
        trust_remote_code=False,
    )
    return model.to(device).eval()


def resolve_max_model_len(requested: int | None, info: ModelInfo) -> int:
    """The model's own limit, or a smaller one; never past what its positions support."""
    limit = info.max_position_embeddings
    if requested is None:
        return limit
    if not 1 <= requested <= limit:
        raise ValueError(
            f"max_model_len={requested} is outside 1..{limit} "
            f"(max_position_embeddings of {info.path})"
        )
    return requested


class CheckpointTensors:
    """All tensors of a safetensors checkpoint, by name, converted on first use."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(folder.glob("*.safetensors"))]
        if not files:
            raise ValueError(f"{folder}: no *.safetensors weights")
        self.where: dict[str, Path] = {}
        for name in files:
            with safe_open(folder / name, framework="pt") as f:
                for key in f.keys():
                    self.where[key] = folder / name

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.where[name], framework="pt") as f:
            tensor = f.get_tensor(name)
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()
