"""Continuous batching decisions: budget, chunks, order, preemption, stops."""

from __future__ import annotations

from engine_core.block_manager import BlockManager
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler, SchedulerOutput
from protocol.controls import HOLD_ALL, HOLD_NEW
from protocol.messages import EngineCoreRequest, FinishReason, SamplingParams

EOS = 99


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int = 8,
    priority: int = 0,
    arrival: float = 0.0,
    prompt: list[int] | None = None,
    group: int = 0,
    **kw,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **kw)
    if prompt is None:  # distinct per id, so no accidental prefix hits
        seed = sum(map(ord, request_id))
        prompt = [(seed * 7 + i * 13) % 50 for i in range(prompt_len)]
    return Request(
        EngineCoreRequest(request_id, prompt, params, arrival, priority=priority, group=group),
        frozenset([EOS]),
    )


def make_scheduler(
    num_blocks: int = 100,
    budget: int = 64,
    max_seqs: int = 16,
    chunk: int = 0,
    policy: str = "fcfs",
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size=4, enable_prefix_caching=True)
    return Scheduler(
        bm, max_seqs, budget, max_model_len=256, long_prefill_token_threshold=chunk, policy=policy
    )


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, [token] * len(out.sampling))
    return out


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_tokens)}


def test_prefill_and_decode_share_one_step_within_the_budget():
    s = make_scheduler(budget=20)
    s.add(make_request("a", 10))
    assert plan(step(s)) == {"a": 10}
    s.add(make_request("b", 30))
    out = step(s)
    # a decodes (1 token) first, b's prefill takes the rest of the budget.
    assert plan(out) == {"a": 1, "b": 19}
    assert [r.request_id for r in out.sampling] == ["a"]
    assert plan(step(s)) == {"a": 1, "b": 11}


def test_long_prefill_threshold_caps_one_request_chunk():
    s = make_scheduler(budget=64, chunk=8)
    s.add(make_request("a", 20))
    s.add(make_request("b", 5))
    assert plan(step(s)) == {"a": 8, "b": 5}
    assert plan(step(s)) == {"a": 8, "b": 1}
    out = step(s)
    assert plan(out) == {"a": 4, "b": 1}
    assert {r.request_id for r in out.sampling} == {"a", "b"}


def test_max_num_seqs_limits_running_requests():
    s = make_scheduler(max_seqs=2)
    for name in "abc":
        s.add(make_request(name, 4))
    assert set(plan(step(s))) == {"a", "b"}
    assert len(s.waiting) == 1


def test_blocks_run_out_so_the_newest_running_request_is_preempted_to_the_front():
    s = make_scheduler(num_blocks=7, budget=64)  # 6 usable blocks of 4 tokens
    s.add(make_request("old", 8, max_tokens=20))
    s.add(make_request("new", 12, max_tokens=20))
    step(s)  # old: 2 blocks, new: 3 blocks, 1 left
    # old's 9th token takes the last block; new's 13th needs a 7th: new is preempted.
    out = step(s)
    assert s.num_preemptions == 1
    assert plan(out) == {"old": 1}
    new = s.waiting.peek()
    assert new.request_id == "new"
    assert new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and new.block_ids == []
    # Its generated token is kept: the recompute covers prompt + output.
    assert new.num_tokens == 13


def test_no_admission_in_a_step_that_preempted():
    s = make_scheduler(num_blocks=4, budget=64)  # 3 usable blocks
    s.add(make_request("a", 4, max_tokens=20))
    s.add(make_request("b", 4, max_tokens=20))
    step(s)
    step(s)  # a: 2 blocks, b needs a second block: b is preempted
    assert s.num_preemptions == 1
    out = s.schedule()
    assert "b" not in plan(out)


def test_waiting_queue_is_fcfs_without_skipping():
    s = make_scheduler(num_blocks=6, budget=64)  # 5 usable blocks
    s.add(make_request("big", 16))  # 4 blocks
    s.add(make_request("huge", 16))  # cannot fit now
    s.add(make_request("tiny", 2))  # would fit, but must wait its turn
    assert set(plan(step(s))) == {"big"}


def test_priority_policy_admits_lower_values_first_then_by_arrival():
    s = make_scheduler(max_seqs=1, policy="priority")
    s.add(make_request("late-high", 3, priority=0, arrival=2.0))
    s.add(make_request("low", 3, priority=9, arrival=0.0))
    s.add(make_request("early-high", 3, priority=0, arrival=1.0))
    assert set(plan(s.schedule())) == {"early-high"}


def test_priority_preempts_the_least_important_running_request():
    s = make_scheduler(num_blocks=5, budget=64, policy="priority")  # 4 usable
    s.add(make_request("vip", 4, priority=0, max_tokens=20, arrival=1.0))
    s.add(make_request("bulk", 4, priority=5, max_tokens=20, arrival=0.0))
    # Each crosses into a second block (4 used), then needs a third: bulk must go.
    for _ in range(6):
        step(s)
    assert s.num_preemptions >= 1
    assert all(r.request_id == "vip" for r in s.running)


def test_update_finishes_on_max_tokens_stop_token_and_eos():
    s = make_scheduler()
    s.add(make_request("len", 3, max_tokens=2))
    s.add(make_request("stop", 3, stop_token_ids=[42]))
    s.add(make_request("eos", 3))
    out = s.schedule()
    finished = s.update(out, [1, 42, EOS])
    reasons = {r.request_id: (r.finish_reason, r.stop_reason) for r in finished}
    assert reasons["stop"] == (FinishReason.STOP, 42)
    assert reasons["eos"] == (FinishReason.STOP, None)
    assert reasons["len"] == (None, None)
    s.update(s.schedule(), [1])
    assert s.running == []
    assert s.blocks.num_free_blocks == s.blocks.num_usable_blocks


def test_min_tokens_defers_stop_checks():
    s = make_scheduler()
    s.add(make_request("a", 3, min_tokens=2, stop_token_ids=[42]))
    s.update(s.schedule(), [42])
    assert s.running and s.running[0].finish_reason is None
    s.update(s.schedule(), [42])
    assert not s.running


def test_ignore_eos_keeps_going():
    s = make_scheduler()
    s.add(make_request("a", 3, max_tokens=3, ignore_eos=True))
    for _ in range(2):
        s.update(s.schedule(), [EOS])
        assert s.running
    s.update(s.schedule(), [EOS])
    assert not s.running


def test_abort_frees_running_and_drops_waiting():
    s = make_scheduler(max_seqs=1)
    a, b = make_request("a", 9), make_request("b", 9)
    s.add(a)
    s.add(b)
    step(s)
    s.finish_aborted(a)
    s.finish_aborted(b)
    assert not s.has_unfinished()
    assert s.blocks.num_free_blocks == s.blocks.num_usable_blocks
    assert a.finish_reason == b.finish_reason == FinishReason.ABORT


def test_a_request_finishing_in_its_prefill_step_still_publishes_its_blocks():
    s = make_scheduler()
    first = make_request("first", 12, max_tokens=1)
    s.add(first)
    step(s)
    assert first.finish_reason == FinishReason.LENGTH
    again = make_request("again", 13, max_tokens=1, prompt=first.all_token_ids[:12] + [1])
    s.add(again)
    out = s.schedule()
    assert plan(out) == {"again": 1}  # 12 of 13 tokens from the prefix cache
    assert s.blocks.prefix_cache_hits == 12


def test_sequences_of_one_request_take_turns_with_other_requests_at_admission():
    s = make_scheduler(budget=64, max_seqs=3)
    for i in range(6):
        s.add(make_request(f"fan{i}", 4, group=1))
    s.add(make_request("alone", 4))
    # The fan-out's lane and the newcomer's lane alternate: the newcomer is second.
    assert list(plan(step(s))) == ["fan0", "alone", "fan1"]


def test_a_fan_out_holding_every_slot_gives_one_back_to_a_newcomer_at_once():
    s = make_scheduler(budget=64, max_seqs=4)
    for i in range(8):
        s.add(make_request(f"fan{i}", 4, max_tokens=50, group=7))
    step(s)
    assert len(s.running) == 4
    s.add(make_request("late", 4, max_tokens=50))
    out = step(s)
    assert "late" in plan(out)  # the very next step, not after a fan-out sequence finishes
    assert s.num_preemptions == 1
    assert sum(r.group_key == "late" for r in s.running) == 1
    # The sequence that gave way waits first in its lane; other lanes' order is unchanged.
    assert s.waiting.peek().request_id == "fan3"


def test_requests_that_run_alone_are_never_preempted_to_share_slots():
    s = make_scheduler(budget=64, max_seqs=2)
    s.add(make_request("a", 4, max_tokens=50))
    s.add(make_request("b", 4, max_tokens=50))
    step(s)
    s.add(make_request("c", 4, max_tokens=50))
    assert set(plan(step(s))) == {"a", "b"}
    assert s.num_preemptions == 0


def test_a_pause_holds_new_requests_back_and_keep_freezes_running_ones():
    s = make_scheduler(budget=20)
    s.add(make_request("a", 4, max_tokens=50))
    assert plan(step(s)) == {"a": 4}
    # HOLD_NEW (modes abort and wait): running requests go on, none is admitted.
    s.hold = HOLD_NEW
    s.add(make_request("b", 4))
    assert plan(step(s)) == {"a": 1}
    assert s.has_unfinished()
    # HOLD_ALL (mode keep): nothing is scheduled, and the busy loop may idle.
    s.hold = HOLD_ALL
    assert plan(step(s)) == {} and not s.has_unfinished()
    assert [r.request_id for r in s.running] == ["a"] and len(s.waiting) == 1
    s.hold = None
    assert plan(step(s)) == {"a": 1, "b": 4}


def test_a_pause_that_holds_new_requests_has_nothing_to_do_once_they_alone_are_left():
    s = make_scheduler()
    s.hold = HOLD_NEW
    s.add(make_request("a", 4))
    assert not s.has_unfinished() and plan(step(s)) == {}
