"""`zserve bench engine` runs end to end (tiny sizes) and reports every figure."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    assert "of matmul rate" in out and "memory floor ms" in out


@pytest.mark.parametrize("prefix_len", ["64", "-1"])
def test_a_prefix_not_shorter_than_the_prompts_is_refused_before_measuring(tmp_path, prefix_len):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    # No model is needed: the check comes before anything loads.
    args = parser.parse_args(
        ["engine", "--model", str(tmp_path / "none"), "--prefill-len", "64"]
        + ["--prefix-len", prefix_len]
    )
    with pytest.raises(SystemExit) as refused:
        args.run(args)
    message = str(refused.value)
    assert f"--prefix-len ({prefix_len})" in message and "--prefill-len (64)" in message


def test_the_limits_count_the_models_weights_and_reads(tiny_model):
    from transformers import AutoModelForCausalLM

    from benchmarks import engine_limits

    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    c = json.loads((path / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    params = layers * per_layer + h * c["vocab_size"]
    lim = engine_limits.limits(model, torch.device("cpu"), threads=1)
    assert lim["weight_bytes"] == 2 * params
    assert lim["matmul_flops"] > 0 and lim["read_bytes_s"] > 0
    # A step of 4 sequences at 10 positions: 2 FLOPs a weight a token, 4 per position
    # and query head dimension in each layer; every weight and the K/V read once.
    fig = engine_limits.decode_figures(lim, batch=4, context=10, step_ms=1.0)
    flops = 4 * (2 * params + 4 * 10 * q * layers)
    assert fig["flops"] == pytest.approx(flops * 1e3)
    kv_bytes = 2 * 4 * 10 * layers * 2 * kv
    floor_ms = (2 * params + kv_bytes) / lim["read_bytes_s"] * 1e3
    assert fig["memory_floor_ms"] == pytest.approx(floor_ms)
    assert fig["of_matmul_rate"] == pytest.approx(flops * 1e3 / lim["matmul_flops"])


def test_kernels_ab_compares_builds_on_one_engine(tiny_model, tmp_path):
    # The same sources twice (one in a copy elsewhere): both builds run, each is timed,
    # and the second's ratios to the first are printed.
    root = Path(__file__).resolve().parents[2]
    copy = tmp_path / "copy"
    shutil.copytree(root / "engine_core" / "csrc", copy / "engine_core" / "csrc")
    run = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "scripts" / "kernels_ab.py"),
         str(tiny_model("llama")), str(root), str(copy), "--batch", "3", "--context", "20",
         "--steps", "2", "--rounds", "2"],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    if run.returncode != 0 and "no one-call forward" in run.stderr:
        pytest.skip("the one-call forward needs the AVX-512 kernels")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [ln for ln in run.stdout.splitlines() if "decode step" in ln]
    assert len(lines) == 2 and lines[0].split(":")[1] != lines[1].split(":")[1], run.stdout
    assert all("prefill" in ln and " x" in ln for ln in lines), run.stdout
