"""The engine's OpenMP spin is set before torch loads, and a user's choice is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROBE = (
    "import os; from engine_core.omp_env import set_up_engine_threads; "
    "set_up_engine_threads(); import torch; "
    "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in __import__('sys').modules)"
)


def _probe(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = subprocess.run(
        [sys.executable, "-c", PROBE], env=base | env, capture_output=True, text=True, check=True
    )
    return run.stdout.strip()


def test_the_engine_gets_a_short_spin_before_torch_loads():
    from engine_core.omp_env import ENGINE_GOMP_SPINCOUNT

    assert _probe() == f"{ENGINE_GOMP_SPINCOUNT} True"


def test_a_users_openmp_settings_win():
    assert _probe(GOMP_SPINCOUNT="123") == "123 True"
    assert _probe(OMP_WAIT_POLICY="ACTIVE") == "None True"
