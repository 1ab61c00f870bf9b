"""`zserve bench serve` against a real `zserve serve` on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(300)

NUM_PROMPTS = 8
IN_LEN = 24
OUT_LEN = 6


@pytest.fixture(scope="module")
def server(default_server: ZServe, tiny_model) -> ZServe:
    """The e2e suite's shared `zserve serve` on the tiny llama (tests/e2e/conftest.py)."""
    default_server.tokenizer_dir = str(tiny_model("llama"))
    return default_server


def bench_serve(server: ZServe, tmp_path, *extra: str) -> dict:
    """Run the real CLI as a subprocess; return its JSON result."""
    cmd = [
        sys.executable, "-m", "launcher.cli", "bench", "serve",
        "--base-url", server.base_url,
        # zserve's /v1/models names no path on its machine, so the tokenizer is given.
        "--tokenizer", server.tokenizer_dir,
        "--num-prompts", str(NUM_PROMPTS),
        "--random-input-len", str(IN_LEN),
        "--random-output-len", str(OUT_LEN),
        "--max-concurrency", "4",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        "--disable-tqdm",
        *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout
    assert (tmp_path / "r.png").exists()
    return json.loads((tmp_path / "r.json").read_text())


def test_completions_load_has_exact_prompt_and_output_lengths(server, tmp_path):
    # No --model: it comes from the server's /v1/models.
    result = bench_serve(server, tmp_path)
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    # usage is the server's own count: the prompts built here have exactly IN_LEN tokens
    assert result["input_lens"] == [IN_LEN] * NUM_PROMPTS
    assert result["output_lens"] == [OUT_LEN] * NUM_PROMPTS
    assert result["output_tokens_recounted"] == 0
    assert all(t > 0 for t in result["ttfts"])
    assert result["output_throughput"] > 0
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0


def test_chat_load_completes_with_server_usage(server, tmp_path):
    result = bench_serve(server, tmp_path, "--backend", "openai-chat", "--goodput", "e2el:60000")
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["output_lens"] == [OUT_LEN] * NUM_PROMPTS
    assert result["backend"] == "openai-chat"
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
