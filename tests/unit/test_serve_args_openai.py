"""`zserve serve` refuses OpenAI-surface flag values that could only fail later."""

from __future__ import annotations

import argparse

import pytest

from launcher import serve_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zserve")
    serve_args.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "model", *argv])


@pytest.mark.parametrize(
    "flag",
    [
        ("--max-logprobs", "-2"),  # -1 means the whole vocabulary; below that is nonsense
        ("--sse-keep-alive-interval", "-1"),
        ("--sse-keep-alive-interval", "nan"),
        ("--metrics-prefix", "my-prefix"),  # no Prometheus name may contain '-'
    ],
)
def test_bad_flag_values_are_refused_with_the_flag_named(flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*flag)
    assert e.value.code == 2
    assert f"argument {flag[0]}:" in capsys.readouterr().err


def test_good_values_pass_through():
    args = parse(
        "--max-logprobs", "5", "--sse-keep-alive-interval", "0.5", "--metrics-prefix", "vllm"
    )  # fmt: skip
    assert (args.max_logprobs, args.sse_keep_alive_interval, args.metrics_prefix) == (
        5,
        0.5,
        "vllm",
    )
