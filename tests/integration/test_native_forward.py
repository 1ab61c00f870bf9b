"""The native Llama-family forward against transformers' forward, on the same batches."""

from __future__ import annotations

import pytest
import torch
from engine_oracle import SMALL_KV, greedy, make_prompts

from engine_core.hf_backend import TransformersBackend
from engine_core.llm import LLM
from engine_core.model_loader import load_model
from engine_core.native_llama import NativeLlamaBackend

pytestmark = pytest.mark.timeout(120)

# fp32: the native path does transformers' arithmetic operation for operation, so the
# logits agree to float rounding of differently fused matmuls (seen: exactly equal).
FP32_ATOL = 1e-4
# bf16 (the benchmark model): one bf16 ulp of a logit of magnitude ~4 is 0.03.
BF16_ATOL = 0.1


class _Both:
    """Runs transformers' forward and the native one on every step; keeps the gap."""

    def __init__(self, native, reference) -> None:
        self.native, self.reference, self.gaps = native, reference, []

    def forward(self, input_ids, positions, attn_meta, logits_indices):
        expected = self.reference.forward(input_ids, positions, attn_meta, logits_indices)
        got = self.native.forward(input_ids, positions, attn_meta, logits_indices)
        self.gaps.append((expected - got).abs().max().item())
        return got


def _compare(model_dir, dtype: str | None = None) -> list[float]:
    # A small budget and chunk cap: steps mix decodes, fresh prompts and continued chunks.
    kwargs = dict(
        kv_cache_memory_bytes=SMALL_KV,
        model_impl="native",
        max_num_batched_tokens=24,
        long_prefill_token_threshold=7,
    )
    if dtype:
        kwargs["dtype"] = dtype
    llm = LLM(str(model_dir), **kwargs)
    runner = llm.engine.runner
    assert isinstance(runner.backend, NativeLlamaBackend)
    reference = TransformersBackend(load_model(runner.info, runner.dtype, runner.device))
    both = runner.backend = _Both(runner.backend, reference)
    llm.generate(make_prompts(), greedy())
    assert len(both.gaps) > 20
    return both.gaps


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_native_logits_match_transformers_fp32(tiny_model, arch):
    gaps = _compare(tiny_model(arch))
    assert max(gaps) <= FP32_ATOL, max(gaps)


@pytest.mark.slow
def test_native_logits_match_transformers_on_the_bf16_benchmark_model(small_model):
    gaps = _compare(small_model, "bfloat16")
    assert max(gaps) <= BF16_ATOL, max(gaps)


def test_auto_takes_the_native_path_where_it_exists(tiny_model):
    assert isinstance(
        LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV).engine.runner.backend,
        NativeLlamaBackend,
    )
    assert isinstance(
        LLM(str(tiny_model("phi3")), kv_cache_memory_bytes=SMALL_KV).engine.runner.backend,
        TransformersBackend,
    )


def test_native_is_refused_clearly_for_other_architectures(tiny_model):
    with pytest.raises(ValueError, match=r"not available for this model.*Phi3ForCausalLM"):
        LLM(str(tiny_model("phi3")), kv_cache_memory_bytes=SMALL_KV, model_impl="native")


def test_rope_tables_match_transformers_positions(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), kv_cache_memory_bytes=SMALL_KV, model_impl="native")
    backend = llm.engine.runner.backend
    assert backend.cos.shape == (llm.engine.max_model_len, backend.head_dim)
    assert torch.isfinite(backend.cos).all() and torch.isfinite(backend.sin).all()
