"""`zserve bench engine` runs end to end (tiny sizes) and reports every figure."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import engine as bench

pytestmark = pytest.mark.timeout(120)


def test_bench_engine_reports_ratios_prefill_and_prefix_cache(tiny_model, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    out = tmp_path / "engine.json"
    args = parser.parse_args(
        ["engine", "--model", str(tiny_model("llama")), "--batch-sizes", "1,4"]
        + ["--decode-steps", "3", "--repeats", "1", "--prefill-len", "48", "--prefill-prompts", "2"]
        + ["--prefix-len", "32", "--prefix-requests", "3", "--dtype", "bfloat16"]
        + ["--kv-cache-memory-bytes", str(1 << 20), "--json", str(out)]
    )
    assert args.run(args) == 0
    result = json.loads(out.read_text())
    assert [d["batch"] for d in result["decode"]] == [1, 4]
    impls = ["native", "native-torch", "transformers"]
    assert result["model_impls"] == impls
    for d in result["decode"]:
        assert d["limit_ms"]["median"] > 0
        assert all(d[impl]["ratio"]["median"] > 0 for impl in impls)
    assert result["prefill"]["engine_tok_s"]["median"] > 0
    # Requests 2 and 3 reuse the 2 full shared blocks: 64 of 144 looked-up tokens.
    assert result["prefix_cache"]["hit_rate"] == pytest.approx(64 / 144)
    out = capsys.readouterr().out
    assert all(name in out for name in ["bare HF loop", *impls])
