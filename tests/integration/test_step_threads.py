"""An engine beside an API server leaves it a core on steps of many streams' tokens,
and keeps every thread for a single stream and for prefill-heavy steps."""

from __future__ import annotations

import pytest
import torch
from engine_oracle import SMALL_KV, greedy, hf_greedy, make_prompts

from engine_core import cpu_kernels
from engine_core.llm import LLM
from engine_core.model_runner import FEW_STREAMS, PREFILL_HEAVY

pytestmark = pytest.mark.timeout(180)


def _run(model, dtype: str, **config) -> tuple[list[list[int]], list[tuple[list[int], int, int]]]:
    """Greedy tokens of the standard prompts, and per step (num_tokens, threads in
    effect, torch's threads)."""
    llm = LLM(str(model), kv_cache_memory_bytes=SMALL_KV, cpu_threads=2, dtype=dtype, **config)
    runner, steps = llm.engine.runner, []
    execute = runner.execute

    def record(plan):
        logits = execute(plan)
        steps.append((list(plan.num_tokens), runner.step_threads, torch.get_num_threads()))
        return logits

    runner.execute = record
    results = llm.generate(make_prompts(), greedy())
    return [r.token_ids for r in results], steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # torch's ops; the CPU kernels
def test_steps_of_many_streams_leave_a_core_and_the_tokens_stay_the_same(tiny_model, dtype):
    kernels = cpu_kernels.load()
    if dtype == "bfloat16" and kernels is not None and kernels.prefer_linear:
        pytest.skip("the kernels' own matmuls run here (AMX tiles, or AVX512-BF16)")
    model = tiny_model("llama")
    spared, steps = _run(model, dtype, spare_core_for_frontend=True)
    for num_tokens, threads, torch_threads in steps:
        decodes = num_tokens.count(1)
        many = decodes > FEW_STREAMS and sum(num_tokens) - decodes < PREFILL_HEAVY
        assert threads == (1 if many else 2), num_tokens
        assert torch_threads <= threads
    assert {threads for _, threads, _ in steps} == {1, 2}
    kept, steps = _run(model, dtype)
    assert {threads for _, threads, _ in steps} == {2}
    assert spared == kept
    if dtype == "float32":
        assert spared == hf_greedy(model, make_prompts())


def test_where_the_kernels_pool_runs_the_matmuls_every_step_keeps_every_thread(
    tiny_model, monkeypatch
):
    # Their pool never waits for a descheduled thread and gives way to the API server
    # (on the Zen boxes two threads served more than one).
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_linear:
        pytest.skip("the kernels' matmul is in the AVX512-BF16 build only")
    monkeypatch.setattr(kernels, "prefer_linear", True)
    model = tiny_model("llama")
    spared, steps = _run(model, "bfloat16", spare_core_for_frontend=True)
    assert {threads for _, threads, _ in steps} == {2}
    # The pool has them, but beside the AMX matmul torch keeps them for its attention.
    assert {torch_threads for _, _, torch_threads in steps} == {2 if kernels.linear_amx else 1}
