"""--runner pooling in the engine: each prompt pooled into the vector transformers'
own model gives (its base model's last hidden states, pooled and normalized), on every
backend and pooler, across prompt chunks and prefix-cache hits; nothing left behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_oracle import SMALL_KV, greedy, make_prompts, request
from hf_generate import reference_model

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from protocol.messages import FinishReason, PoolingParams, SamplingParams

pytestmark = pytest.mark.timeout(180)

POOL = SamplingParams(max_tokens=1)
LENGTHS = (5, 1, 17, 40, 90)


def pooling_engine(model_dir, pooling_type: str = "LAST", **kw) -> EngineCore:
    kw.setdefault("kv_cache_memory_bytes", SMALL_KV)
    return EngineCore(
        EngineConfig(model=str(model_dir), runner="pooling", pooling_type=pooling_type, **kw)
    )


def pool_all(engine: EngineCore, prompts, params: PoolingParams | None = None) -> list:
    params = params or PoolingParams()
    for i, prompt in enumerate(prompts):
        assert engine.add_request(request(f"p{i}", prompt, POOL, pooling=params)) == []
    outputs = {}
    while engine.has_unfinished_requests():
        for outs in engine.step().values():
            for out in outs:
                assert out.request_id not in outputs  # one output each
                outputs[out.request_id] = out
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    assert not engine.requests
    outs = [outputs[f"p{i}"] for i in range(len(prompts))]
    assert all(o.finish_reason is FinishReason.STOP and o.new_token_ids == [] for o in outs)
    return [np.frombuffer(o.pooled, dtype="<f4") for o in outs]


def reference(model_dir, prompts, pooling_type: str, dtype=torch.float32) -> list[np.ndarray]:
    model = reference_model(model_dir, dtype)
    vectors = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()
            pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
            vectors.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return vectors


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_vectors_are_transformers_pooled_hidden_states(tiny_model, impl, pooling_type):
    model_dir = tiny_model("llama")
    prompts = make_prompts(LENGTHS)
    # Steps of 32 tokens: the 40- and 90-token prompts are pooled across chunks.
    engine = pooling_engine(model_dir, pooling_type, model_impl=impl, max_num_batched_tokens=32)
    got = pool_all(engine, prompts)
    for vector, expected in zip(got, reference(model_dir, prompts, pooling_type)):
        assert vector.shape == (engine.hidden_size,)
        np.testing.assert_allclose(vector, expected, atol=2e-5)
        assert abs(np.linalg.norm(vector) - 1.0) < 1e-5


def test_bf16_kernels_match_within_bf16_rounding(small_model):
    # bf16 on the CPU kernels (the layers one call each: the one-call decoder ends
    # in the LM head, which pooling has none of).
    prompts = make_prompts((7, 64, 130))
    engine = pooling_engine(small_model, dtype="bfloat16", kv_cache_memory_bytes=16 << 20)
    got = pool_all(engine, prompts)
    for vector, expected in zip(got, reference(small_model, prompts, "LAST", torch.bfloat16)):
        cosine = float(vector @ expected) / float(np.linalg.norm(expected))
        assert cosine > 0.999


def test_prefix_cache_hits_pool_the_same_vector(tiny_model):
    engine = pooling_engine(tiny_model("llama"))
    prompt = make_prompts((70,))[0]
    first = pool_all(engine, [prompt])[0]
    hits = engine.blocks.prefix_cache_hits
    again = pool_all(engine, [prompt])[0]
    assert engine.blocks.prefix_cache_hits > hits  # the second pass read the cache
    np.testing.assert_allclose(again, first, atol=1e-6)


def test_dimensions_and_no_normalization(tiny_model):
    model_dir = tiny_model("llama")
    prompts = make_prompts((9,))
    engine = pooling_engine(model_dir)
    raw = pool_all(engine, prompts, PoolingParams(use_activation=False))[0]
    with torch.no_grad():
        hidden = reference_model(model_dir).model(input_ids=torch.tensor(prompts)).last_hidden_state
    np.testing.assert_allclose(raw, hidden[0, -1].numpy(), atol=2e-5)
    cut = pool_all(engine, prompts, PoolingParams(dimensions=8))[0]
    np.testing.assert_allclose(cut, raw[:8] / np.linalg.norm(raw[:8]), atol=1e-5)


def test_each_engine_refuses_the_other_kind_of_request(tiny_model):
    model_dir = tiny_model("llama")
    pooler = pooling_engine(model_dir)
    (out,) = pooler.add_request(request("g", [1, 2, 3], greedy(2)))
    assert out.finish_reason is FinishReason.REFUSED and "--runner pooling" in out.error
    (out,) = pooler.add_request(request("d", [1, 2], POOL, pooling=PoolingParams(dimensions=0)))
    assert out.finish_reason is FinishReason.REFUSED
    assert out.error == f"dimensions must be in 1..{pooler.hidden_size}; got 0"
    too_long = [1] * (pooler.max_model_len + 1)
    (out,) = pooler.add_request(request("l", too_long, POOL, pooling=PoolingParams()))
    assert "exceeds max_model_len" in out.error
    # A prompt of exactly max_model_len tokens fits: nothing is generated after it.
    full = make_prompts((pooler.max_model_len,))[0]
    assert len(pool_all(pooler, [full])[0]) == pooler.hidden_size
    generator = EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory_bytes=SMALL_KV))
    (out,) = generator.add_request(request("p", [1, 2], POOL, pooling=PoolingParams()))
    assert out.finish_reason is FinishReason.REFUSED and "--runner pooling" in out.error
