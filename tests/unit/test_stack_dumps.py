"""A hung engine writes where it hangs before the supervisor kills it; any zserve
process writes its stacks on SIGUSR1 (launcher/process_setup.py, engine_set.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from launcher.children import Child
from launcher.engine_set import LocalEngines
from launcher.process_setup import STACKS_SIGNAL, set_up_child

pytestmark = pytest.mark.timeout(60)


def spin_in_a_kernel_that_never_returns(ready) -> None:
    """A stand-in for an engine stuck in a step: set up as engines are, then spin."""
    set_up_child("engine0", "INFO", None, None)
    ready.set()
    while True:
        pass


def _hung_engine() -> Child:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    process = ctx.Process(target=spin_in_a_kernel_that_never_returns, args=(ready,))
    process.start()
    assert ready.wait(30)
    return Child("engine 0", process, rank=0)


def test_a_hung_engine_writes_its_stacks_then_is_killed(capfd):
    engines = LocalEngines()
    child = engines.children[0] = _hung_engine()
    t0 = time.monotonic()
    engines.stop(0, dump_stacks=True)
    took = time.monotonic() - t0
    assert not child.process.is_alive()
    assert child.process.exitcode in (-9, -15)  # by a signal, not its own exit
    err = capfd.readouterr().err
    assert "most recent call first" in err, err
    assert "spin_in_a_kernel_that_never_returns" in err, err
    print(f"stacks and kill in {took:.2f} s")


def test_an_engine_stopped_without_a_dump_writes_nothing(capfd):
    engines = LocalEngines()
    child = engines.children[0] = _hung_engine()
    engines.stop(0)
    assert not child.process.is_alive()
    assert "spin_in_a_kernel_that_never_returns" not in capfd.readouterr().err


def test_sigusr1_asks_for_stacks_and_the_process_goes_on(capfd):
    child = _hung_engine()
    try:
        for _ in range(2):
            os.kill(child.process.pid, STACKS_SIGNAL)
            time.sleep(0.3)
            assert child.process.is_alive()
        err = capfd.readouterr().err
        assert err.count("spin_in_a_kernel_that_never_returns") == 2, err
    finally:
        child.process.kill()
        child.process.join(10)
