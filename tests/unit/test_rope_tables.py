"""rope.py's cos/sin tables against transformers' own rotary module of every native
architecture, bit for bit, for every rope type the native forward takes."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig

from engine_core import rope
from engine_core.native_llama import NATIVE_ARCHITECTURES

pytestmark = pytest.mark.timeout(120)

HEAD_DIM = 16
PRETRAINED = 64  # original_max_position_embeddings of the scaled types
LONGEST = 256  # max_position_embeddings
ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": PRETRAINED,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": PRETRAINED,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + i / 16 for i in range(HEAD_DIM // 2)],
        "long_factor": [2.0 + i / 4 for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": PRETRAINED,
    },
}
# The model types of the native architectures (the folder of each one's modeling file).
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES |= {"Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}


def _config(model_type: str, rope_parameters: dict):
    return AutoConfig.for_model(
        model_type,
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=LONGEST,
        rope_parameters=dict(rope_parameters),
    )


def _transformers_tables(arch: str, config, length: int, dtype: torch.dtype):
    """transformers' own rotary module of `arch` (LlamaForCausalLM: LlamaRotaryEmbedding)."""
    kind = MODEL_TYPES[arch]
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    rotary = getattr(module, arch.removesuffix("ForCausalLM") + "RotaryEmbedding")(config)
    cos, sin = rotary(torch.empty(1, dtype=dtype), torch.arange(length)[None])
    return cos[0], sin[0]


def test_every_native_architecture_is_covered():
    assert set(MODEL_TYPES) == set(NATIVE_ARCHITECTURES)


@pytest.mark.parametrize("arch", sorted(MODEL_TYPES))
@pytest.mark.parametrize("kind", sorted(ROPE_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [PRETRAINED // 2, LONGEST])  # longrope: short, then long
def test_tables_equal_the_rotary_module_bit_for_bit(arch, kind, dtype, length):
    config = _config(MODEL_TYPES[arch], ROPE_TYPES[kind])
    assert config.rope_parameters["rope_type"] == kind
    cos, sin = rope.rope_tables(config, length, dtype, torch.device("cpu"))
    expected_cos, expected_sin = _transformers_tables(arch, config, length, dtype)
    assert cos.shape == (length, HEAD_DIM)
    assert cos.dtype == dtype
    assert torch.equal(cos, expected_cos)
    assert torch.equal(sin, expected_sin)


def test_longrope_takes_the_long_factors_past_the_pretraining_length():
    config = _config("llama", ROPE_TYPES["longrope"])
    short, _ = rope.rope_tables(config, PRETRAINED, torch.float32, torch.device("cpu"))
    long, _ = rope.rope_tables(config, PRETRAINED + 1, torch.float32, torch.device("cpu"))
    assert not torch.equal(short, long[:PRETRAINED])


def test_a_dynamic_rope_is_refused_by_name():
    config = _config("llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="'dynamic' depends on the sequence length"):
        rope.rope_tables(config, 8, torch.float32, torch.device("cpu"))
