"""EngineCore as the process shell drives it: add, step, abort, errors, stats, start-up."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_oracle import SMALL_KV, greedy, make_prompts, request

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.llm import LLM
from engine_core.model_loader import SUPPORTED_ARCHITECTURES
from protocol.messages import FinishReason, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return EngineCore(EngineConfig(model=str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV))


def run_to_completion(engine: EngineCore) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for outs in engine.step().values():
            for out in outs:
                outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_ready_fields_describe_the_loaded_model(engine):
    assert engine.max_model_len == 1024
    assert engine.block_size == 16
    assert engine.num_kv_blocks == 128
    assert engine.dtype == "float32"
    assert engine.device == ("cuda:0" if torch.cuda.is_available() else "cpu")  # device "auto"
    assert engine.vocab_size == 320


def test_each_step_outputs_one_token_per_request_grouped_by_client(engine):
    prompts = make_prompts((5, 9, 14))
    for i, prompt in enumerate(prompts):
        assert engine.add_request(request(f"c{i}", prompt, greedy(4), client_index=i % 2)) == []
    grouped = engine.step()
    assert sorted(grouped) == [0, 1]
    assert sorted(o.request_id for o in grouped[0]) == ["c0", "c2"]
    outputs = run_to_completion(engine)
    for i in range(3):
        outs = outputs[f"c{i}"]
        assert [len(o.new_token_ids) for o in outs] == [1, 1, 1]
        assert [o.finish_reason for o in outs] == [None, None, FinishReason.LENGTH]


def test_abort_frees_every_block_and_produces_no_output(engine):
    prompts = make_prompts((40, 70, 25, 33))
    for i, prompt in enumerate(prompts):
        engine.add_request(request(f"a{i}", prompt, greedy(50)))
    engine.step()
    engine.step()
    before = engine.make_stats()
    assert before.num_free_blocks < before.num_total_blocks
    engine.abort_requests(["a0", "a1", "a2", "a3", "never-existed"])
    engine.abort_requests(["a0"])  # idempotent
    stats = engine.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_aborted == before.num_aborted + 4
    assert not engine.has_unfinished_requests()
    assert engine.step() == {}


def test_the_default_running_limit_is_vllms_for_the_device(tiny_model):
    # vLLM's server runs at most 128 sequences on the CPU and 256 on a GPU by default.
    engine = EngineCore(
        EngineConfig(model=str(tiny_model("llama")), kv_cache_memory_bytes=2 * SMALL_KV)
    )
    limit = 128 if engine.device == "cpu" else 256
    assert engine.config.max_num_seqs == engine.scheduler.max_num_seqs == limit
    for i, prompt in enumerate(make_prompts((4,) * 130)):
        engine.add_request(request(f"r{i}", prompt, greedy(2)))
    engine.step()
    stats = engine.make_stats()
    assert (stats.num_running, stats.num_waiting) == (min(130, limit), 130 - min(130, limit))
    engine.abort_requests([f"r{i}" for i in range(130)])


def test_abort_of_a_waiting_request(tiny_model):
    engine = EngineCore(
        EngineConfig(model=str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV, max_num_seqs=1)
    )
    engine.add_request(request("first", make_prompts((8,))[0], greedy(3)))
    engine.add_request(request("second", make_prompts((8,))[0], greedy(3)))
    engine.step()
    assert engine.make_stats().num_waiting == 1
    engine.abort_requests(["second"])
    outputs = run_to_completion(engine)
    assert list(outputs) == ["first"]


BAD_PARAMS = [
    ("temperature", SamplingParams(temperature=-1.0)),
    ("top_p", SamplingParams(top_p=0.0)),
    ("top_k", SamplingParams(top_k=-2)),
    ("min_p", SamplingParams(min_p=1.5)),
    ("repetition_penalty", SamplingParams(repetition_penalty=0.0)),
    ("presence_penalty", SamplingParams(presence_penalty=3.0)),
    ("frequency_penalty", SamplingParams(frequency_penalty=float("nan"))),
    ("max_tokens", SamplingParams(max_tokens=0)),
    ("min_tokens", SamplingParams(max_tokens=4, min_tokens=5)),
    ("logprobs", SamplingParams(logprobs=21)),
    ("prompt_logprobs", SamplingParams(prompt_logprobs=-1)),
    ("stop_token_ids", SamplingParams(stop_token_ids=[320])),
    ("logit_bias", SamplingParams(logit_bias={5: 101.0})),
    ("logit_bias", SamplingParams(logit_bias={-1: 1.0})),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=[])),
    ("seed", SamplingParams(seed=2**64)),
]


@pytest.mark.parametrize(
    "field,params", BAD_PARAMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PARAMS)]
)
def test_invalid_params_get_an_error_output_and_the_engine_keeps_serving(engine, field, params):
    (out,) = engine.add_request(request("bad", [1, 2, 3], params))
    assert out.finish_reason == FinishReason.REFUSED
    assert out.request_id == "bad"
    assert field in out.error
    assert not engine.has_unfinished_requests()
    assert engine.add_request(request("good", [1, 2, 3], greedy(2))) == []
    assert len(run_to_completion(engine)["good"]) == 2


@pytest.mark.parametrize(
    "prompt,needle",
    [([], "prompt_token_ids"), ([1, 320], "prompt_token_ids"), ([5] * 1020, "max_model_len")],
)
def test_bad_prompts_get_an_error_output(engine, prompt, needle):
    (out,) = engine.add_request(request("bad-prompt", prompt, greedy(8)))
    assert out.finish_reason == FinishReason.REFUSED
    assert needle in out.error


def test_request_that_can_never_fit_the_kv_cache_gets_an_error_not_a_hang(tiny_model):
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    engine = EngineCore(
        EngineConfig(model=str(tiny_model("llama")), kv_cache_memory_bytes=5 * block_bytes)
    )
    (out,) = engine.add_request(request("huge", [7] * 60, greedy(10)))
    assert out.finish_reason == FinishReason.REFUSED
    assert "KV blocks" in out.error
    # 4 usable blocks hold 64 tokens: 60 + 5 - 1 fits exactly.
    assert engine.add_request(request("fits", [7] * 60, greedy(5))) == []
    assert len(run_to_completion(engine)["fits"]) == 5


def test_max_request_tokens_is_where_the_engine_starts_refusing(tiny_model, engine):
    # What READY announces (EngineReady.max_request_tokens) is the limit _check_fits keeps.
    assert engine.max_request_tokens == engine.max_model_len  # a roomy cache: the context
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    small = EngineCore(
        EngineConfig(model=str(tiny_model("llama")), kv_cache_memory_bytes=5 * block_bytes)
    )
    assert small.max_request_tokens == 4 * 16 + 1  # 4 usable blocks; the last token needs none
    prompt = [7] * (small.max_request_tokens - 5)
    assert small.add_request(request("at-limit", prompt, greedy(5))) == []
    (out,) = small.add_request(request("over-limit", prompt, greedy(6)))
    assert out.finish_reason == FinishReason.REFUSED


def test_duplicate_request_id_is_refused_while_the_first_is_alive(engine):
    assert engine.add_request(request("dup", [1, 2, 3], greedy(3))) == []
    (out,) = engine.add_request(request("dup", [4, 5, 6], greedy(3)))
    assert out.finish_reason == FinishReason.REFUSED
    assert "already" in out.error
    outputs = run_to_completion(engine)
    assert len(outputs["dup"]) == 3
    assert engine.add_request(request("dup", [4, 5, 6], greedy(1))) == []
    run_to_completion(engine)


def test_priority_policy_serves_lower_priority_values_first(tiny_model):
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_model("llama")),
            kv_cache_memory_bytes=SMALL_KV,
            max_num_seqs=1,
            scheduling_policy="priority",
        )
    )
    for name, priority in (("low", 5), ("high", -1), ("mid", 2)):
        engine.add_request(request(name, [1, 2, 3], greedy(2), priority=priority))
    order = []
    while engine.has_unfinished_requests():
        for outs in engine.step().values():
            order += [o.request_id for o in outs if o.finished]
    assert order == ["high", "mid", "low"]


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use(engine):
    prompt = make_prompts((40,))[0]
    engine.add_request(request("p1", prompt, greedy(3)))
    engine.step()
    assert engine.reset_prefix_cache() is False
    run_to_completion(engine)
    assert engine.reset_prefix_cache() is True
    hits = engine.make_stats().prefix_cache_hits
    engine.add_request(request("p2", prompt, greedy(3)))
    run_to_completion(engine)
    assert engine.make_stats().prefix_cache_hits == hits


def test_stats_count_tokens_steps_and_usage(engine):
    before = engine.make_stats()
    engine.add_request(request("s1", [3] * 20, greedy(5)))
    engine.step()
    mid = engine.make_stats()
    assert mid.num_running == 1
    assert 0 < mid.kv_cache_usage < 1
    run_to_completion(engine)
    after = engine.make_stats()
    assert after.num_steps == before.num_steps + 5
    assert after.prompt_tokens_computed - before.prompt_tokens_computed <= 20
    assert after.generation_tokens == before.generation_tokens + 5
    assert after.kv_cache_usage == 0.0
    assert after.step_time_s > 0


def test_unsupported_architecture_is_refused_with_the_supported_list(tiny_model, tmp_path):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        EngineCore(EngineConfig(model=str(folder)))
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_the_logprob_limit_is_the_servers_max_logprobs(tiny_model):
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=25)
    strict = LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV)
    (refused,) = strict.generate([[1, 2, 3]], params)
    assert refused.error and "0..20" in refused.error
    generous = LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV, max_logprobs=30)
    (result,) = generous.generate([[1, 2, 3]], params)
    assert result.error is None and len(result.logprobs.token_ids[0]) == 26  # chosen + 25
    everything = LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV, max_logprobs=-1)
    (result,) = everything.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=300))
    assert result.error is None
