"""The engine's adapters: registered, loaded (an LRU of --max-cpu-loras), active (at most
--max-loras), loads on their own thread; and how the scheduler and the prefix cache
treat requests that name one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lora_files import TARGETS, write_adapter
from test_scheduler import make_request, plan, step

from engine_core import lora_manager
from engine_core.block_manager import BlockManager
from engine_core.lora_adapter import LoraError
from engine_core.lora_manager import LoraManager
from engine_core.scheduler import Scheduler
from protocol.messages import LoraConfig, LoraModule

pytestmark = pytest.mark.timeout(60)


def manager(tmp_path: Path, names=("a", "b", "c"), loaded=2, active=1, startup=None):
    modules = [
        LoraModule(n, str(write_adapter(tmp_path / n, seed=i)))
        for i, n in enumerate(startup if startup is not None else names)
    ]
    config = LoraConfig(max_loras=active, max_lora_rank=8, max_cpu_loras=loaded, modules=modules)
    m = LoraManager(config, TARGETS, prepare=lambda w: ("packed", w.name))
    m.load_startup()
    return m


def settle(m: LoraManager) -> list:
    """Wait for every load under way and take it in."""
    failed = []
    while m.loading:
        failed += m.poll(wait_s=5.0)
    return failed


def test_start_up_loads_the_first_max_cpu_loras_and_registers_all(tmp_path):
    m = manager(tmp_path)
    assert [s[0] for s in m.list()] == ["a", "b", "c"]
    assert m.loaded_names() == ["a", "b"]
    assert m.lookup("c").adapter is None and m.lookup("c").digest  # checked, then dropped
    with pytest.raises(LoraError, match="does not exist"):
        m.lookup("zz")


def test_a_bad_start_up_adapter_stops_the_engine_with_its_reason(tmp_path):
    folder = write_adapter(tmp_path / "a", rank=16)
    config = LoraConfig(max_lora_rank=8, modules=[LoraModule("a", str(folder))])
    with pytest.raises(LoraError, match="rank 16 is above --max-lora-rank 8"):
        LoraManager(config, TARGETS, prepare=lambda w: w).load_startup()


def test_at_most_max_loras_adapters_run_at_once(tmp_path):
    m = manager(tmp_path, active=1)
    a, b = m.lookup("a"), m.lookup("b")
    assert m.try_activate(a) and m.try_activate(a)  # the same adapter: no new slot
    assert not m.try_activate(b)
    m.release(a)
    assert not m.try_activate(b)
    m.release(a)
    assert m.try_activate(b)


def test_an_adapter_not_in_memory_loads_off_the_step_and_evicts_the_oldest_idle_one(tmp_path):
    m = manager(tmp_path, loaded=2, active=2)
    a, c = m.lookup("a"), m.lookup("c")
    assert m.try_activate(a)  # a runs; b is the least recently used idle one
    assert not m.try_activate(c) and m.loading
    assert settle(m) == []
    assert m.loaded_names() == ["a", "c"]
    assert m.try_activate(c)


def test_an_adapter_in_use_is_never_evicted(tmp_path):
    m = manager(tmp_path, loaded=2, active=2)
    a, b, c = m.lookup("a"), m.lookup("b"), m.lookup("c")
    assert m.try_activate(a) and m.try_activate(b)
    assert not m.try_activate(c)
    assert not m.loading  # no room: a and b both run
    m.release(b)
    assert not m.try_activate(c) and m.loading
    settle(m)
    assert sorted(m.loaded_names()) == ["a", "c"] and a.adapter is not None


def test_a_runtime_load_answers_once_loaded_and_checks_names_at_once(tmp_path):
    m = manager(tmp_path, names=("a",), loaded=2)
    version = m.version
    done = m.add("d", str(write_adapter(tmp_path / "d", seed=7)))
    assert not done.done()
    with pytest.raises(LoraError, match="is being loaded"):
        m.add("d", str(tmp_path / "d"))
    settle(m)
    assert done.result() is True and m.version == version + 1
    assert m.lookup("d").adapter == ("packed", "d")
    with pytest.raises(LoraError, match="has already been loaded"):
        m.add("d", str(tmp_path / "d"))
    with pytest.raises(LoraError, match="must start with a letter"):
        m.add("../d", str(tmp_path / "d"))


def test_a_bad_runtime_load_fails_its_future_and_registers_nothing(tmp_path):
    m = manager(tmp_path, names=("a",))
    done = m.add("d", str(tmp_path / "missing"))
    settle(m)
    with pytest.raises(LoraError, match="is not a folder"):
        done.result()
    assert [s[0] for s in m.list()] == ["a"]


def test_load_in_place_replaces_the_adapter_but_not_for_requests_already_holding_it(tmp_path):
    m = manager(tmp_path, names=("a",), loaded=3, active=2)
    old = m.lookup("a")
    assert m.try_activate(old)
    done = m.add("a", str(write_adapter(tmp_path / "a2", seed=9)), replace=True)
    settle(m)
    assert done.result() and m.lookup("a") is not old and m.lookup("a").digest != old.digest
    assert old.adapter is not None  # still running
    m.release(old)
    assert old.adapter is None  # gone with its last request


def test_unload_drops_the_name_and_refuses_unknown_ones(tmp_path):
    m = manager(tmp_path, names=("a", "b"))
    a = m.lookup("a")
    assert m.try_activate(a)
    m.remove("a")
    with pytest.raises(LoraError, match="does not exist"):
        m.lookup("a")
    assert a.adapter is not None  # its running request finishes with it
    m.release(a)
    assert a.adapter is None and m.loaded_names() == ["b"]
    with pytest.raises(LoraError, match="cannot be found"):
        m.remove("a")


def test_a_reload_that_fails_is_reported_so_its_requests_can_end(tmp_path):
    m = manager(tmp_path, loaded=2, active=2)
    c = m.lookup("c")
    shutil.rmtree(tmp_path / "c")
    assert not m.try_activate(c)
    assert settle(m) == [c] and "is not a folder" in c.error
    assert not m.try_activate(c) and not m.loading  # no retry loop


def test_the_number_of_adapters_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(lora_manager, "MAX_LORA_ADAPTERS", 2)
    m = manager(tmp_path, names=("a", "b"))
    with pytest.raises(LoraError, match="already holds 2 LoRA adapters"):
        m.add("d", str(tmp_path / "a"))


def test_limits_are_checked(tmp_path):
    with pytest.raises(ValueError, match="max_loras"):
        LoraManager(LoraConfig(max_loras=3, max_cpu_loras=2), TARGETS, prepare=lambda w: w)


# --- the scheduler and the prefix cache ------------------------------------------------


def lora_scheduler(m: LoraManager, max_seqs: int = 16) -> Scheduler:
    blocks = BlockManager(100, block_size=4, enable_prefix_caching=True)
    return Scheduler(blocks, max_seqs, 64, max_model_len=256, loras=m)


def with_lora(request, m: LoraManager, name: str):
    request.lora = m.lookup(name)
    request.hash_seed = request.lora.digest
    return request


def test_a_request_waits_for_a_slot_and_those_behind_it_go_first(tmp_path):
    m = manager(tmp_path, loaded=3, active=1)
    s = lora_scheduler(m)
    s.add(with_lora(make_request("a1", 4, max_tokens=3), m, "a"))
    s.add(with_lora(make_request("b1", 4, max_tokens=3), m, "b"))
    s.add(make_request("base", 4, max_tokens=3))
    assert plan(step(s)) == {"a1": 4, "base": 4}  # b1 waits: max_loras 1, a runs
    assert [r.request_id for r in s.waiting._lanes[0]] == ["b1"]
    step(s)
    step(s)  # a1 and base finish
    assert not s.running and m.num_active == 0
    assert plan(step(s)) == {"b1": 4}
    assert m.num_active == 1


def test_a_request_whose_adapter_is_loading_waits_then_runs(tmp_path):
    m = manager(tmp_path, loaded=2, active=2)
    s = lora_scheduler(m)
    s.add(with_lora(make_request("c1", 4, max_tokens=2), m, "c"))
    assert plan(step(s)) == {}
    settle(m)
    assert plan(step(s)) == {"c1": 4}


def test_preempted_and_finished_requests_give_their_slot_back(tmp_path):
    m = manager(tmp_path, loaded=3, active=2)
    s = lora_scheduler(m)
    s.add(with_lora(make_request("a1", 4, max_tokens=2), m, "a"))
    s.add(with_lora(make_request("b1", 4, max_tokens=2), m, "b"))
    step(s)
    assert m.num_active == 2
    s._preempt(s.running[-1])
    assert m.num_active == 1
    s.finish_aborted(s.running[0])
    assert m.num_active == 0 and m.lookup("a").running == 0


def test_the_same_tokens_under_another_adapter_never_share_kv_blocks(tmp_path):
    m = manager(tmp_path, names=("a", "b"), loaded=2, active=2)
    prompt = list(range(12))
    blocks = BlockManager(100, block_size=4, enable_prefix_caching=True)
    hashes = {}
    for key, name in (("base", None), ("a", "a"), ("a again", "a"), ("b", "b")):
        request = make_request(key, 0, prompt=prompt)
        if name:
            with_lora(request, m, name)
        blocks.hash_blocks(request)
        hashes[key] = request.block_hashes
    assert hashes["a"] == hashes["a again"]
    assert len({tuple(h) for h in hashes.values()}) == 3
    assert not set(hashes["a"]) & set(hashes["base"]) and not set(hashes["a"]) & set(hashes["b"])
