"""Beam search in the engine: width 1 is greedy; without EOS it answers what
transformers' generate(num_beams=...) answers; with EOS, what vLLM's online beam search
answers; however the engine batches, forks, preempts and aborts, no KV block leaks and no
beam's copy-on-write disturbs another sequence."""

from __future__ import annotations

import pytest
from beam_oracle import assert_same_answers, hf_beam_search, load, vllm_beam_search
from engine_oracle import SMALL_KV, greedy, hf_greedy, make_prompts, request

from engine_core.llm import LLM
from protocol.messages import EarlyStopping, SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPTS = make_prompts((5, 17, 33))  # a partial last block each: forks copy it
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 heads, dim 16, fp32


def beams(width: int, max_tokens: int = 12, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, beam_width=width, **kw)


def search(llm: LLM, prompts, params):
    return [r.beams for r in llm.generate(prompts, params)]


def assert_no_blocks_held(llm: LLM) -> None:
    stats = llm.engine.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert set(llm.engine.blocks.ref_counts) == {0}  # nothing freed twice either
    assert not llm.engine.requests and not llm.engine.scheduler.running


@pytest.fixture(scope="module")
def llama(tiny_model):
    path = tiny_model("llama")
    return path, load(path)


@pytest.mark.parametrize(
    ("arch", "impl"),
    [("llama", "native"), ("qwen2", "transformers"), ("gemma2", "transformers")],
)
def test_width_1_is_greedy_token_for_token(tiny_model, arch, impl):
    """The greedy path itself equals transformers' (test_engine_conformance.py)."""
    llm = LLM(str(tiny_model(arch)), kv_cache_memory_bytes=SMALL_KV, model_impl=impl)
    prompts = make_prompts((5, 17, 40))
    expected = [r.token_ids for r in llm.generate(prompts, greedy())]
    got = search(llm, prompts, beams(1, max_tokens=16, ignore_eos=True))
    assert [b[0].token_ids for b in got] == expected
    assert_no_blocks_held(llm)


def test_width_1_is_transformers_greedy(llama):
    path, _ = llama
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV)
    got = search(llm, PROMPTS, beams(1, max_tokens=16, ignore_eos=True))
    assert [b[0].token_ids for b in got] == hf_greedy(path, PROMPTS)


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping"),
    [(2, 1.0, False), (3, 0.0, True), (4, 2.0, "never"), (5, -0.5, False)],
)
def test_matches_transformers_beam_search(llama, width, length_penalty, early_stopping):
    path, model = llama
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV)
    rule = {False: EarlyStopping.HEURISTIC, True: EarlyStopping.FIRST, "never": EarlyStopping.EXACT}
    params = beams(
        width,
        ignore_eos=True,
        length_penalty=length_penalty,
        early_stopping=rule[early_stopping],
    )
    for prompt, got in zip(PROMPTS, search(llm, PROMPTS, params)):
        expected = hf_beam_search(model, prompt, width, 12, length_penalty, early_stopping)
        assert_same_answers(got, expected)
    assert_no_blocks_held(llm)


def eos_on_the_way(llm: LLM, prompt: list[int]) -> int:
    """A token the greedy path takes at its third step: made EOS, beams meet it."""
    (result,) = llm.generate([prompt], greedy(4))
    return result.token_ids[2]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_with_eos_matches_vllm_beam_search(llama, length_penalty):
    path, model = llama
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV)
    stopped = 0
    for prompt in PROMPTS:
        eos = eos_on_the_way(llm, prompt)
        llm.engine.eos_token_ids = frozenset([eos])
        (got,) = search(llm, [prompt], beams(4, length_penalty=length_penalty))
        expected = vllm_beam_search(model, prompt, 4, 12, eos, length_penalty)
        assert_same_answers(got, expected)
        assert [b.finish_reason.openai_name for b in got] == [a.finish_reason for a in expected]
        stopped += sum(b.token_ids[-1] == eos for b in got)
    # The rule was really exercised (a penalty above 1 favours the longest beams).
    assert stopped or length_penalty > 1
    assert_no_blocks_held(llm)


def test_searches_and_samples_in_one_batch_leave_each_other_alone(llama):
    """Forks copy partial blocks while other sequences decode beside them: every answer
    equals the one it gets alone."""
    path, _ = llama
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV)
    alone = [search(llm, [p], beams(3))[0] for p in PROMPTS]
    greedy_alone = [r.token_ids for r in llm.generate(PROMPTS, greedy())]
    mixed = llm.generate(PROMPTS + PROMPTS, [beams(3)] * 3 + [greedy()] * 3)
    for result, expected in zip(mixed, alone):  # batched: the last bits of a float differ
        assert_same_answers(result.beams, expected)
    assert [r.token_ids for r in mixed[3:]] == greedy_alone
    assert_no_blocks_held(llm)


def test_beams_share_the_prompt_blocks(llama):
    """n beams over a 40-token prompt hold its 2 full blocks once, not n times."""
    path, _ = llama
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV, enable_prefix_caching=False)
    engine = llm.engine
    prompt = make_prompts((40,))[0]
    engine.add_request(request("s", prompt, beams(4, max_tokens=20)))
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.blocks.num_usable_blocks - engine.blocks.num_free_blocks)
    # 2 shared prompt blocks + per beam its copy of the partial block (8 prompt tokens
    # and up to 19 of its own: at most 2 blocks): never the 4 x 3 of unshared beams.
    assert max(used) <= 2 + 4 * 2
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preempted_searches_answer_as_if_never_preempted(llama, policy):
    path, _ = llama
    params = beams(3, 20, ignore_eos=True)
    expected = search(LLM(str(path), kv_cache_memory_bytes=SMALL_KV), PROMPTS, params)
    # 12 usable blocks: each search alone fits (6, 7 and 8 blocks at most), all three do not.
    llm = LLM(str(path), kv_cache_memory_bytes=13 * BLOCK_BYTES, scheduling_policy=policy)
    for got, answers in zip(search(llm, PROMPTS, params), expected):
        assert_same_answers(got, answers)
    assert llm.engine.make_stats().num_preemptions > 0
    assert_no_blocks_held(llm)


def test_aborted_search_frees_every_block(llama):
    path, _ = llama
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV)
    engine = llm.engine
    engine.add_request(request("s", PROMPTS[2], beams(4, max_tokens=30)))
    for _ in range(6):  # the prompt, then beams that forked
        engine.step()
    assert engine.scheduler.num_running_seqs == 4
    engine.abort_requests(["s"])
    assert_no_blocks_held(llm)
    assert engine.make_stats().num_running == 0


def test_a_repeated_search_reuses_the_cached_prompt(llama):
    path, _ = llama
    llm = LLM(str(path), kv_cache_memory_bytes=SMALL_KV)
    prompt = make_prompts((40,))[0]
    first = llm.generate([prompt], beams(3))
    again = llm.generate([prompt], beams(3))
    # Bit for bit on CPU; a GPU's kernels for a cached prefix round differently (~1e-6).
    for a, b in zip(again[0].beams, first[0].beams, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, rel=1e-5)
    assert again[0].num_cached_tokens == 32
    assert_no_blocks_held(llm)


def test_refuses_what_it_cannot_run(llama):
    path, _ = llama
    llm = LLM(str(path), kv_cache_memory_bytes=8 * BLOCK_BYTES, max_num_seqs=4)
    (too_wide,) = llm.generate([PROMPTS[0]], beams(5))
    assert "--max-num-seqs" in too_wide.error
    (too_big,) = llm.generate([PROMPTS[0]], beams(4, max_tokens=40))
    assert "KV blocks" in too_big.error
