"""LoRA fidelity: greedy output with an adapter equals transformers + PEFT generate() with
that adapter merged, token for token, for several architectures and both forward paths,
with the base model and two adapters mixed in one batch, through chunked prefill and
preemption."""

from __future__ import annotations

import pytest
from engine_oracle import SMALL_KV, greedy, make_prompts
from hf_generate import hf_greedy

from engine_core.llm import LLM
from launcher.tiny_lora import build_tiny_lora
from protocol.messages import LoraConfig, LoraModule

pytestmark = pytest.mark.timeout(180)

# The Llama family natively (its batched LoRA matmul), the rest through transformers
# (phi3: fused qkv_proj and gate_up_proj adapters).
PATHS = [
    ("llama", "native"),
    ("qwen3", "native"),
    ("qwen2", "transformers"),
    ("phi3", "transformers"),
    ("gemma2", "transformers"),
]
PROMPTS = make_prompts((5, 17, 33, 40, 64, 1))
NUM_NEW = 10
NAMES = [None, "a", "b", "a", "b", None]  # base and two adapters, interleaved


def merged_greedy(model_dir, adapter, prompts) -> list[list[int]]:
    """transformers' generate() with the adapter merged into the weights (PEFT), fp32."""
    return hf_greedy(model_dir, prompts, NUM_NEW, adapter)


@pytest.fixture(scope="module")
def oracle(tiny_model, tmp_path_factory):
    """Per architecture: the model, its two adapters, and the expected output per prompt."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = tiny_model(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            adapters = {
                "a": build_tiny_lora(model, root / "a", seed=1, rank=8),
                # q and v only, an odd rank, rsLoRA scaling
                "b": build_tiny_lora(
                    model, root / "b", seed=2, rank=5, targets="qv", use_rslora=True
                ),
            }
            by_adapter = {
                name: merged_greedy(model, adapters.get(name), PROMPTS) for name in (None, "a", "b")
            }
            expected = [by_adapter[name][i] for i, name in enumerate(NAMES)]
            assert by_adapter["a"] != by_adapter[None] != by_adapter["b"]  # they matter
            cache[arch] = (model, adapters, expected)
        return cache[arch]

    return get


def lora_llm(model, adapters, impl, **overrides) -> LLM:
    modules = [LoraModule(name, str(path)) for name, path in adapters.items()]
    lora = LoraConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2, modules=modules)
    overrides.setdefault("kv_cache_memory_bytes", SMALL_KV)
    return LLM(str(model), model_impl=impl, lora=lora, **overrides)


@pytest.mark.parametrize(("arch", "impl"), PATHS)
def test_base_and_two_adapters_in_one_batch_match_peft_merged(oracle, arch, impl):
    model, adapters, expected = oracle(arch)
    llm = lora_llm(model, adapters, impl)
    results = llm.generate(PROMPTS, greedy(NUM_NEW), lora_names=NAMES)
    assert [r.token_ids for r in results] == expected
    assert llm.engine.make_stats().num_steps <= NUM_NEW + 1  # one batch, not one per adapter


@pytest.mark.parametrize(("arch", "impl"), [PATHS[0], PATHS[1], PATHS[3]])
def test_chunked_prefill_and_preemption_keep_each_adapter(oracle, arch, impl):
    model, adapters, expected = oracle(arch)
    # 13 blocks of 16 tokens (fp32, 2 layers, 2 KV heads of 16): the 64-token prompt alone
    # needs 5; a budget of 24 and chunks of 7 split every prompt over steps.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    llm = lora_llm(
        model,
        adapters,
        impl,
        kv_cache_memory_bytes=13 * block_bytes,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=7,
    )
    results = llm.generate(PROMPTS, greedy(NUM_NEW), lora_names=NAMES)
    assert [r.token_ids for r in results] == expected
    stats = llm.engine.make_stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_more_adapters_than_max_loras_wait_for_a_slot_and_still_match(oracle):
    model, adapters, expected = oracle("llama")
    modules = [LoraModule(name, str(path)) for name, path in adapters.items()]
    # One adapter at a time and one in memory: b's requests wait for a's to finish, and
    # b is read from its folder again when its turn comes.
    lora = LoraConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1, modules=modules)
    llm = LLM(str(model), kv_cache_memory_bytes=SMALL_KV, model_impl="native", lora=lora)
    results = llm.generate(PROMPTS, greedy(NUM_NEW), lora_names=NAMES)
    assert [r.token_ids for r in results] == expected
    assert all(r.error is None for r in results)


def test_a_prompt_cached_under_one_adapter_is_not_reused_under_another(oracle):
    model, adapters, _ = oracle("llama")
    llm = lora_llm(model, adapters, "native")
    prompt = make_prompts((48,), seed=5)
    first = llm.generate(prompt, greedy(2), lora_names=["a"])
    again = llm.generate(prompt, greedy(2), lora_names=["a"])
    other = llm.generate(prompt, greedy(2), lora_names=["b"])
    base = llm.generate(prompt, greedy(2))
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 32
    assert other[0].num_cached_tokens == 0 and base[0].num_cached_tokens == 0


def test_a_runtime_load_serves_like_a_start_up_one(oracle):
    model, adapters, expected = oracle("qwen2")
    llm = lora_llm(model, {"a": adapters["a"]}, "transformers")
    llm.add_lora("b", str(adapters["b"]))
    results = llm.generate(PROMPTS, greedy(NUM_NEW), lora_names=NAMES)
    assert [r.token_ids for r in results] == expected


def test_a_request_for_an_unknown_adapter_is_refused(oracle):
    model, adapters, _ = oracle("llama")
    llm = lora_llm(model, adapters, "native")
    (result,) = llm.generate(PROMPTS[:1], greedy(NUM_NEW), lora_names=["zz"])
    assert result.error == "The model `zz` does not exist." and not result.token_ids
    plain = LLM(str(model), kv_cache_memory_bytes=SMALL_KV)
    (result,) = plain.generate(PROMPTS[:1], greedy(NUM_NEW), lora_names=["a"])
    assert "LoRA is not enabled" in result.error
