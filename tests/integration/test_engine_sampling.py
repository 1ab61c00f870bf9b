"""What the engine returns besides greedy tokens: logprobs, seeded sampling, stops."""

from __future__ import annotations

import pytest
import torch
from engine_oracle import SMALL_KV, greedy, hf_log_softmax, make_prompts

from engine_core.llm import LLM
from protocol.messages import FinishReason, SamplingParams

pytestmark = pytest.mark.timeout(120)

EOS = 258  # the tiny models' <|im_end|>


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(str(llama), kv_cache_memory_bytes=SMALL_KV)


def _check_against_full_forward(reference: torch.Tensor, positions, logprobs, top_n: int):
    """Row i of `logprobs` is about the token predicted from `positions[i]`."""
    for row, pos in enumerate(positions):
        ids, lps, rank = logprobs.token_ids[row], logprobs.logprobs[row], logprobs.ranks[row]
        expected = reference[pos]
        assert lps[0] == pytest.approx(expected[ids[0]].item(), abs=1e-4)
        assert rank == int((expected > expected[ids[0]]).sum()) + 1
        top_lp, top_ids = expected.topk(top_n)
        assert ids[1:] == top_ids.tolist()
        assert lps[1:] == pytest.approx(top_lp.tolist(), abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_logprobs_equal_log_softmax_of_a_full_forward(llm, llama, temperature):
    prompt = make_prompts((21,))[0]
    params = SamplingParams(
        max_tokens=8,
        temperature=temperature,
        ignore_eos=True,
        logprobs=5,
        prompt_logprobs=3,
        seed=7,
    )
    (result,) = llm.generate([prompt], params)
    reference = hf_log_softmax(llama, prompt + result.token_ids)
    # Raw logprobs: the model's distribution, whatever the temperature did to sampling.
    sampled = result.logprobs
    assert [row[0] for row in sampled.token_ids] == result.token_ids
    _check_against_full_forward(reference, range(20, 28), sampled, 5)
    prompt_lp = result.prompt_logprobs
    assert [row[0] for row in prompt_lp.token_ids] == prompt[1:]
    _check_against_full_forward(reference, range(0, 20), prompt_lp, 3)


def test_prompt_logprobs_accumulate_across_prefill_chunks(llama):
    prompt = make_prompts((45,))[0]
    params = greedy(4, prompt_logprobs=2)
    whole = LLM(str(llama), kv_cache_memory_bytes=SMALL_KV).generate([prompt], params)[0]
    chunked_llm = LLM(str(llama), kv_cache_memory_bytes=SMALL_KV, max_num_batched_tokens=8)
    chunked = chunked_llm.generate([prompt], params)[0]
    assert len(chunked.prompt_logprobs.ranks) == 44
    assert chunked.prompt_logprobs.token_ids == whole.prompt_logprobs.token_ids
    got = torch.tensor(chunked.prompt_logprobs.logprobs)
    assert torch.allclose(got, torch.tensor(whole.prompt_logprobs.logprobs), atol=1e-5)
    assert chunked.token_ids == whole.token_ids


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch_of_8(llm):
    _check_seeded_batch_independence(llm)


def test_seeded_sampling_through_the_cpu_kernels_is_batch_independent_too(llama):
    llm = LLM(str(llama), kv_cache_memory_bytes=SMALL_KV, dtype="bfloat16", device="cpu")
    assert llm.engine.sampler.kernels is not None  # the fused softmax and draw
    _check_seeded_batch_independence(llm)


def _check_seeded_batch_independence(llm: LLM) -> None:
    prompts = make_prompts()
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    (alone,) = llm.generate([prompts[1]], seeded)
    others = [
        SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),
        greedy(),
        SamplingParams(max_tokens=20, temperature=0.7, top_k=5, seed=99, ignore_eos=True),
    ]
    params = [others[i % 3] for i in range(8)]
    params[5] = seeded
    batch = llm.generate([prompts[i] if i != 5 else prompts[1] for i in range(8)], params)
    assert batch[5].token_ids == alone.token_ids
    # A different seed takes a different path (the test can fail).
    (other,) = llm.generate([prompts[1]], SamplingParams(**{**_fields(seeded), "seed": 4321}))
    assert other.token_ids != alone.token_ids


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_stop_token_lands_exactly_where_the_model_produces_it(llm):
    prompt = make_prompts((12,))[0]
    (free,) = llm.generate([prompt], greedy(16))
    tokens = free.token_ids
    # The first position k >= 3 whose token did not occur before it.
    k = next(i for i in range(3, 16) if tokens[i] not in tokens[:i])
    (stopped,) = llm.generate([prompt], greedy(16, stop_token_ids=[tokens[k]]))
    assert stopped.token_ids == tokens[: k + 1]
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.stop_reason == tokens[k]


def test_min_tokens_holds_back_stop_tokens(llm):
    prompt = make_prompts((12,))[0]
    (free,) = llm.generate([prompt], greedy(16))
    stop = free.token_ids[0]
    (held,) = llm.generate([prompt], greedy(16, stop_token_ids=[stop], min_tokens=6))
    assert stop not in held.token_ids[:6]
    assert len(held.token_ids) >= 6


def test_eos_stops_unless_ignore_eos(llm):
    prompt = make_prompts((9,))[0]
    forced = {EOS: 100.0}
    params = SamplingParams(max_tokens=5, temperature=0.0, logit_bias=forced)
    (stopped,) = llm.generate([prompt], params)
    assert stopped.token_ids == [EOS]
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.stop_reason is None
    ignoring = SamplingParams(max_tokens=5, temperature=0.0, logit_bias=forced, ignore_eos=True)
    (ran,) = llm.generate([prompt], ignoring)
    assert ran.token_ids == [EOS] * 5
    assert ran.finish_reason == FinishReason.LENGTH


def test_max_tokens_finishes_with_length(llm):
    (result,) = llm.generate(make_prompts((7,)), greedy(9))
    assert len(result.token_ids) == 9
    assert result.finish_reason == FinishReason.LENGTH


def test_allowed_token_ids_and_penalties_shape_the_output(llm):
    prompt = make_prompts((10,))[0]
    allowed = [65, 66, 67]
    (only,) = llm.generate([prompt], SamplingParams(max_tokens=12, allowed_token_ids=allowed))
    assert set(only.token_ids) <= set(allowed)
    (free,) = llm.generate([prompt], greedy(24))
    penalty = greedy(24, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    (penalized,) = llm.generate([prompt], penalty)
    assert len(set(penalized.token_ids)) > len(set(free.token_ids))
