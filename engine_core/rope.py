"""RoPE's cos/sin tables for the native forward, computed once for every position.

transformers computes them in each architecture's rotary module, which lives in the
architecture's modeling file; importing one imports transformers' `modeling_utils`
(torch._dynamo, triton, ...), 0.4-1.7 s of CPU in every engine start (BENCHMARKS.md
§1, thirty-fifth session) that the native forward needs for nothing else. The tables
are a few operations on the inverse frequencies, and those come from transformers' own
`modeling_rope_utils` for every scaled rope type (linear, llama3, yarn, longrope), so
they are computed here without the modeling files. tests/unit/test_rope_tables.py
holds them equal, bit for bit, to the rotary modules of every native architecture,
for every rope type.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_type(config: PretrainedConfig) -> str:
    return (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")


def inverse_frequencies(config: PretrainedConfig, length: int) -> tuple[torch.Tensor, float]:
    """The frequencies and the cos/sin scale of a table of `length` positions."""
    params = config.rope_parameters
    kind = params["rope_type"]
    if "dynamic" in kind:  # rescaled for every forward's length: no table computed once
        raise ValueError(f"rope type {kind!r} depends on the sequence length")
    if kind == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    compute = ROPE_INIT_FUNCTIONS[kind]
    inv_freq, scale = compute(config)
    if kind == "longrope":
        # transformers takes the long factors for a forward whose positions pass the
        # pretraining length, and keeps the scale of the first computation.
        pretrained = params["original_max_position_embeddings"]
        if length > pretrained:
            inv_freq, _ = compute(config, None, seq_len=pretrained + 1)
    return inv_freq, scale


def rope_tables(
    config: PretrainedConfig, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [length, head_dim] each, in `dtype`: rotate-half layout (the
    frequencies twice over), angles in fp32 as transformers computes them."""
    inv_freq, scale = inverse_frequencies(config, length)
    positions = torch.arange(length, device=device).float()
    angles = positions[:, None] * inv_freq.to(device=device, dtype=torch.float)
    angles = torch.cat((angles, angles), dim=-1)
    cos = (angles.cos() * scale).to(dtype)
    sin = (angles.sin() * scale).to(dtype)
    return cos.contiguous(), sin.contiguous()
