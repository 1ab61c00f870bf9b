"""`zserve bench frontend` runs both servers end to end and reports per-API-server rates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)


def test_bench_frontend_measures_zserve_beside_bare_starlette(tiny_model, tmp_path):
    out = tmp_path / "frontend.json"
    run = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "bench", "frontend",
         "--model", str(tiny_model("llama")), "--api-server-counts", "1",
         "--concurrency", "8", "--rounds", "1", "--output-len", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())
    assert [(r["server"], r["api_servers"]) for r in rows] == [("bare-starlette", 1), ("zserve", 1)]
    for r in rows:
        assert r["completed"] == 64 and r["failed"] == 0 and r["output_tok_s"] > 0
    assert "tok/s/API" in run.stdout
