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


def test_api_key_open_paths_are_routes_of_the_table_or_vllm(capsys):
    from frontend.app import OPEN_PATHS, api_key_open_paths

    assert parse("--api-key-open-paths", "vllm").api_key_open_paths == ["vllm"]
    assert parse("--api-key-open-paths", "/tokenize,/load").api_key_open_paths == [
        "/tokenize",
        "/load",
    ]
    vllm_open = {"/tokenize", "/detokenize", "/invocations", "/load", "/tokenizer_info"}
    vllm_open |= {"/pooling", "/classify", "/score", "/rerank"}  # outside /v1 and /v2
    assert api_key_open_paths(["vllm"]) == OPEN_PATHS | vllm_open
    assert api_key_open_paths([]) == OPEN_PATHS
    with pytest.raises(SystemExit):
        parse("--api-key-open-paths", "/tokenize,/nope")
    assert "'/nope' is not a route of this server" in capsys.readouterr().err


def test_help_says_the_api_key_guards_more_than_vllms(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "Unlike vLLM, whose key guards /v1 only, this also guards /tokenize, /detokenize, /invocations, /load"
        in text
    )
    assert "--api-key-open-paths" in text and "vLLM's exact behaviour" in text
    assert parse("--return-tokens-as-token-ids").return_tokens_as_token_ids
