"""`zserve bench serve --lora-modules`: requests spread over model names at random, as
vLLM's benchmark does, so one run mixes the base model and its adapters."""

from __future__ import annotations

import collections

import pytest
from bench_fake_openai import fake_openai_server
from test_bench_serve_cli import bench

pytestmark = pytest.mark.timeout(120)


def test_lora_modules_spread_requests_over_names_reproducibly(tiny_model):
    def run() -> list[str]:
        with fake_openai_server() as server:
            code = bench(
                "serve",
                "--base-url", server.base_url,
                "--tokenizer", str(tiny_model("llama")),
                "--num-prompts", "40",
                "--random-input-len", "8",
                "--random-output-len", "2",
                "--max-concurrency", "8",
                "--lora-modules", "fake-model", "a", "b",
                "--disable-tqdm",
            )  # fmt: skip
            assert code == 0
            return [b["model"] for b in server.bodies]

    first = run()
    counts = collections.Counter(first[1:])  # after the probe
    assert set(counts) == {"fake-model", "a", "b"} and sum(counts.values()) == 40
    assert sorted(run()) == sorted(first)  # the same draw for the same --seed
