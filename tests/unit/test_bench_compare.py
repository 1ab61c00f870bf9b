"""`zserve bench compare`: alternating rounds against two servers, ratios, JSON."""

from __future__ import annotations

import argparse
import json

import pytest
from bench_fake_openai import fake_openai_server

from benchmarks.cli import add_parser

pytestmark = pytest.mark.timeout(120)


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="zserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.run(args)


def test_compare_alternates_servers_and_prints_ratios(tmp_path, tiny_model, capsys):
    with fake_openai_server() as a, fake_openai_server() as b:
        code = bench(
            "compare",
            "--base-url-a", a.base_url, "--base-url-b", b.base_url,
            "--label-a", "left", "--label-b", "right", "--model-b", "other-name",
            "--tokenizer", str(tiny_model("llama")),
            "--num-prompts", "5", "--random-input-len", "12", "--random-output-len", "3",
            "--max-concurrency", "2", "--rounds", "2", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "cmp.json",
        )  # fmt: skip
        a_times, b_times = a.arrivals, b.arrivals
        b_models = {body["model"] for body in b.bodies}
    assert code == 0
    assert b_models == {"other-name"}
    # probe A, probe B, then rounds A B A B of 5 requests each
    assert len(a_times) == len(b_times) == 11
    a1, a2 = a_times[1:6], a_times[6:]
    b1, b2 = b_times[1:6], b_times[6:]
    assert max(a1) < min(b1) and max(b1) < min(a2) and max(a2) < min(b2)
    out = capsys.readouterr().out
    assert "A = left vs B = right" in out
    for figure in ("output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"):
        assert figure in out
    saved = json.loads((tmp_path / "cmp.json").read_text())
    level = saved["levels"][0]
    assert level["max_concurrency"] == 2
    assert len(level["left"]) == len(level["right"]) == 2
    assert all(run["completed"] == 5 for run in level["left"] + level["right"])


def test_compare_refuses_identical_labels(tiny_model):
    code = bench(
        "compare", "--base-url-a", "http://127.0.0.1:9", "--base-url-b", "http://127.0.0.1:9",
        "--label-a", "x", "--label-b", "x", "--tokenizer", str(tiny_model("llama")),
    )  # fmt: skip
    assert code == 2
