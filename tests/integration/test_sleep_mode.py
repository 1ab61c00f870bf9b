"""Sleep mode inside one engine (engine_core/sleep_mode.py): the memory really goes back
to the OS (this process's RSS, measured around each step), comes back on wake-up, and
the engine then serves exactly what it served before; requests kept across a sleep
finish as if nothing had happened."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_oracle import greedy, make_prompts, request

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.sleep_mode import SleepMode, resident_bytes

pytestmark = pytest.mark.timeout(180)

KV_BYTES = 128 << 20
MiB = 2**20


def run(engine: EngineCore, prompts: list[list[int]], tag: str, num_new: int = 8) -> list:
    for i, prompt in enumerate(prompts):
        assert engine.add_request(request(f"{tag}{i}", prompt, greedy(num_new))) == []
    return finish(engine, [f"{tag}{i}" for i in range(len(prompts))])


def finish(engine: EngineCore, ids: list[str], tokens: dict | None = None) -> list:
    tokens = tokens if tokens is not None else {}
    while engine.has_unfinished_requests():
        for outs in engine.step().values():
            for out in outs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[i] for i in ids]


@pytest.fixture(scope="module")
def small_engine(small_model):
    """The 19.7M-parameter llama: weights large enough to see leave."""
    config = EngineConfig(model=str(small_model), device="cpu", kv_cache_memory_bytes=KV_BYTES)
    return EngineCore(config)


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def test_level_1_gives_the_kv_cache_back_and_level_2_the_weights_too(small_engine, small_model):
    engine, sleep = small_engine, SleepMode(small_engine)
    prompts = make_prompts((7, 30, 12))
    expected = run(engine, prompts, "before")
    kv = engine.runner.kv_cache_bytes
    weights = checkpoint_bytes(small_model)
    for level in (1, 2):
        awake = resident_bytes()
        result = sleep.sleep(level)
        asleep = resident_bytes()
        assert sleep.asleep and engine.runner.kv_cache_bytes == 0
        assert result["kv_cache_bytes"] == kv and result["level"] == level
        woken = sleep.wake_up()
        after = resident_bytes()
        assert not sleep.asleep and woken["restored"] == (
            ["kv_cache"] if level == 1 else ["weights", "kv_cache"]
        )
        by_release = {k: f"{v / MiB:.1f} MiB" for k, v in result["rss_freed_bytes"].items()}
        print(
            f"level {level}: RSS awake {awake / MiB:.1f} MiB, asleep {asleep / MiB:.1f} MiB "
            f"(freed {(awake - asleep) / MiB:.1f} MiB: {by_release}; KV cache {kv / MiB:.1f} "
            f"MiB, checkpoint {weights / MiB:.1f} MiB), woken {after / MiB:.1f} MiB"
        )
        # At least most of the KV cache's bytes left the process, and at level 2 at
        # least most of the weights' (the checkpoint's size) after them.
        assert awake - asleep >= 0.9 * kv
        assert result["rss_freed_bytes"]["kv_cache"] >= 0.9 * kv
        if level == 2:
            assert result["rss_freed_bytes"]["weights"] >= 0.5 * weights
            assert awake - asleep >= 0.9 * kv + 0.5 * weights
        assert after - asleep >= 0.9 * kv  # the KV cache came back on wake-up
        # Woken up (level 2: weights read again from disk), it serves exactly as before.
        assert run(engine, prompts, f"after{level}-") == expected


def test_wake_up_by_tags_restores_only_what_they_name(tiny_model):
    engine = EngineCore(EngineConfig(model=str(tiny_model("llama")), kv_cache_memory_bytes=1 << 20))
    sleep = SleepMode(engine)
    assert sleep.wake_up()["conflict"]  # awake: nothing to wake
    assert sleep.sleep(2)["released"] == ["kv_cache", "weights"]
    assert sleep.sleep(1)["conflict"].startswith("already asleep at level 2")
    assert sleep.wake_up(["weights"])["restored"] == ["weights"]
    assert sleep.asleep and sleep.level == 2 and engine.runner.backend is not None
    assert sleep.wake_up(["weights"])["restored"] == []  # back already
    assert sleep.wake_up(["kv_cache"])["restored"] == ["kv_cache"]
    assert not sleep.asleep and sleep.level == 0
    with pytest.raises(ValueError, match="unknown wake-up tags"):
        sleep.wake_up(["gpu"])


def test_requests_kept_across_a_sleep_finish_as_if_uninterrupted(tiny_model):
    config = EngineConfig(model=str(tiny_model("llama")), kv_cache_memory_bytes=1 << 20)
    prompts = make_prompts((5, 40, 17, 64))
    expected = run(EngineCore(config), prompts, "ref", num_new=24)
    engine = EngineCore(config)
    sleep = SleepMode(engine)
    ids = [f"k{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(request(rid, prompt, greedy(24)))
    tokens: dict = {}
    for _ in range(6):  # mid-generation
        for outs in engine.step().values():
            for out in outs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    running = len(engine.scheduler.running)
    assert running and sleep.sleep(2)["preempted"] == running
    assert not engine.scheduler.running and engine.has_unfinished_requests()
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    sleep.wake_up()
    assert finish(engine, ids, tokens) == expected
