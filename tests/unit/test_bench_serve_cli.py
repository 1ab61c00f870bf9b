"""`zserve bench serve` end to end against the scripted in-process server."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from bench_fake_openai import fake_openai_server

from benchmarks.cli import add_parser

pytestmark = pytest.mark.timeout(120)


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="zserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.run(args)


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model):
    return str(tiny_model("llama"))


def test_sweep_writes_one_json_and_png_per_concurrency(tmp_path, tokenizer_dir, capsys):
    with fake_openai_server() as server:
        code = bench(
            "serve",
            "--base-url", server.base_url,
            "--tokenizer", tokenizer_dir,
            "--num-prompts", "6",
            "--random-input-len", "16",
            "--random-output-len", "4",
            "--max-concurrency", "1,3",
            "--goodput", "ttft:60000", "e2el:60000",
            "--save-result",
            "--result-dir", str(tmp_path),
            "--result-filename", "run.json",
            "--disable-tqdm",
        )  # fmt: skip
        bodies = server.bodies
    assert code == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TTFT (ms)" in out
    for level in (1, 3):
        result = json.loads((tmp_path / f"run-c{level}.json").read_text())
        assert (tmp_path / f"run-c{level}.png").stat().st_size > 10_000
        assert result["completed"] == 6 and result["failed"] == 0
        assert result["max_concurrency"] == level
        assert result["model_id"] == "fake-model"  # from GET /v1/models
        assert result["output_lens"] == [4] * 6
        assert result["total_output_tokens"] == 24
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
        assert len(result["itls"]) == 6 and all(len(gaps) == 3 for gaps in result["itls"])
        for key in ("mean_ttft_ms", "p90_itl_ms", "p99_e2el_ms", "median_tpot_ms", "ttfts"):
            assert key in result
    # probe + two levels of 6; random prompts ask the server to ignore EOS
    assert len(bodies) == 13
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 4 for b in bodies)


def test_chat_backend_with_sharegpt_and_custom_headers(tmp_path, tokenizer_dir):
    data = [
        {"conversations": [{"value": f"ok question number {i}"}, {"value": "a fine answer"}]}
        for i in range(3)
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    with fake_openai_server() as server:
        code = bench(
            "serve",
            "--base-url", server.base_url,
            "--backend", "openai-chat",
            "--model", "fake-model",
            "--tokenizer", tokenizer_dir,
            "--dataset-name", "sharegpt",
            "--dataset-path", str(path),
            "--num-prompts", "3",
            "--api-key", "sk-test",
            "--header", "X-Tenant=blue",
            "--disable-tqdm",
        )  # fmt: skip
        bodies, headers = server.bodies, server.headers
    assert code == 0
    assert all("messages" in b and "ignore_eos" not in b for b in bodies)
    assert all(h["Authorization"] == "Bearer sk-test" for h in headers)
    assert all(h["X-Tenant"] == "blue" for h in headers)


def test_tokenizer_defaults_to_the_served_model_root(tokenizer_dir):
    with fake_openai_server() as server:
        server.models = [{"id": "m", "root": tokenizer_dir}]
        code = bench(
            "serve", "--base-url", server.base_url, "--num-prompts", "2",
            "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm",
        )  # fmt: skip
        assert {b["model"] for b in server.bodies} == {"m"}
    assert code == 0


def test_unreachable_server_fails_fast_with_a_message(tokenizer_dir, capsys):
    code = bench(
        "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
        "--tokenizer", tokenizer_dir, "--num-prompts", "2", "--disable-tqdm",
    )  # fmt: skip
    assert code == 1
    assert "probe request" in capsys.readouterr().err


def test_missing_tokenizer_is_a_usage_error(capsys):
    code = bench("serve", "--model", "m", "--tokenizer", "/nonexistent", "--disable-tqdm")
    assert code == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_load_generator_modules_do_not_import_torch():
    code = (
        "import sys, benchmarks.serve, benchmarks.compare, benchmarks.ipc, benchmarks.plot; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
