"""Greedy output equals transformers' generate() token for token, for every allowlisted
architecture and both forward paths (transformers', and the native one of the Llama
family), however the engine batches, chunks, caches and preempts."""

from __future__ import annotations

import pytest
from engine_oracle import (
    SMALL_KV,
    greedy,
    hf_greedy,
    make_prompts,
    shared_prefix_prompts,
)

from engine_core.llm import LLM
from engine_core.model_loader import SUPPORTED_ARCHITECTURES
from engine_core.native_llama import NATIVE_ARCHITECTURES
from launcher.tiny_model import ARCHS

# Every architecture through transformers' forward; the Llama family also natively.
_NATIVE = {
    a for a in ARCHS if f"{a}ForCausalLM".lower() in {n.lower() for n in NATIVE_ARCHITECTURES}
}
PATHS = [(a, "transformers") for a in ARCHS] + [(a, "native") for a in ARCHS if a in _NATIVE]
assert len(SUPPORTED_ARCHITECTURES) == len(ARCHS) and len(_NATIVE) == 4

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def oracle(tiny_model):
    """Per architecture: (model dir, prompts, expected) for the plain and shared-prefix sets."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tiny_model(arch)
            prompts = make_prompts()
            shared = shared_prefix_prompts()
            cache[arch] = (
                path,
                prompts,
                hf_greedy(path, prompts),
                shared,
                hf_greedy(path, shared),
            )
        return cache[arch]

    return get


@pytest.mark.parametrize(("arch", "impl"), PATHS)
def test_greedy_alone_matches_transformers(oracle, arch, impl):
    path, prompts, expected, _, _ = oracle(arch)
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV, model_impl=impl)
    for i in (0, 1, 5):  # 5, 17 and 1 prompt tokens
        (result,) = llm.generate([prompts[i]], greedy())
        assert result.token_ids == expected[i]


@pytest.mark.parametrize(("arch", "impl"), PATHS)
def test_greedy_batch_of_8_different_lengths_matches_transformers(oracle, arch, impl):
    path, prompts, expected, _, _ = oracle(arch)
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV, model_impl=impl)
    results = llm.generate(prompts, greedy())
    assert [r.token_ids for r in results] == expected
    # They really ran together: 8 prompts, 16 tokens each, in about 16 steps.
    assert llm.engine.make_stats().num_steps <= 17


@pytest.mark.parametrize(("arch", "impl"), PATHS)
def test_chunked_prefill_matches_transformers(oracle, arch, impl):
    path, prompts, expected, _, _ = oracle(arch)
    llm = LLM(
        str(path),
        kv_cache_memory_bytes=SMALL_KV,
        model_impl=impl,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=7,
    )
    results = llm.generate(prompts, greedy())
    assert [r.token_ids for r in results] == expected
    stats = llm.engine.make_stats()
    # The 90-token prompt alone needs 13 chunks of at most 7 before its 16 tokens.
    assert stats.num_steps >= 13 + 16 - 1
    assert stats.prompt_tokens_computed == sum(map(len, prompts))


@pytest.mark.parametrize(("arch", "impl"), PATHS)
def test_shared_prefix_is_served_from_prefix_cache(oracle, arch, impl):
    path, _, _, shared, expected = oracle(arch)
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV, model_impl=impl)
    first = llm.generate(shared[:1], greedy())
    rest = llm.generate(shared[1:], greedy())
    assert [r.token_ids for r in first + rest] == expected
    # 40 shared tokens = 2 full blocks of 16 reused by each later request.
    assert [r.num_cached_tokens for r in rest] == [32, 32]
    stats = llm.engine.make_stats()
    assert stats.prefix_cache_hits == 64
    assert stats.prefix_cache_queries == sum(map(len, shared))


@pytest.mark.parametrize(("arch", "impl"), PATHS)
def test_preemption_by_recompute_matches_transformers(oracle, arch, impl):
    path, prompts, expected, _, _ = oracle(arch)
    # 12 usable blocks of 16 tokens: the longest request alone needs 7 of them.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 heads, dim 16, fp32
    llm = LLM(str(path), kv_cache_memory_bytes=13 * block_bytes, model_impl=impl)
    assert llm.engine.num_kv_blocks == 13
    results = llm.generate(prompts, greedy())
    assert [r.token_ids for r in results] == expected
    stats = llm.engine.make_stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    # vLLM's request_num_preemptions: one observation per finished request, and every
    # preemption belongs to one of them.
    assert sum(stats.request_preemptions_counts) == len(prompts)
    assert stats.request_preemptions_sum == stats.num_preemptions
