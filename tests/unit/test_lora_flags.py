"""LoRA's flags, vLLM's names: parsing, refusals before anything starts, the plan every
engine (headless ones too) and API server gets; and make-tiny-model --lora."""

from __future__ import annotations

import argparse
import json
import os

import pytest
from lora_files import write_adapter
from test_launch_plan import parse

from engine_core.config import EngineConfig, EngineProcConfig
from engine_core.process import EngineCoreProc
from launcher import plan
from launcher.arg_types import lora_module
from launcher.engine_handshake import engine_plan
from launcher.plan import build_plan
from launcher.tiny_lora import build_tiny_lora
from launcher.tiny_model import run
from protocol.handshake import decode_handshake, encode_handshake
from protocol.messages import LoraConfig, LoraModule


def test_lora_modules_take_vllms_two_forms():
    assert lora_module("sql=/a/sql") == LoraModule("sql", "/a/sql")
    text = '{"name": "sql", "path": "/a/sql", "base_model_name": "base"}'
    assert lora_module(text) == LoraModule("sql", "/a/sql", "base")
    for bad in ("just-a-name", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 4}', "{oops"):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)


def test_the_plan_gives_every_engine_the_settings_and_absolute_paths(tmp_path, monkeypatch):
    write_adapter(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    args = parse(
        "m", "--enable-lora", "--lora-modules", "a=a", "--max-loras", "2", "--max-lora-rank", "32"
    )
    assert plan.refuse_unsupported(args) is None
    launch = build_plan(args, "/models/m", "/models/m")
    assert launch.engine.lora == LoraConfig(
        max_loras=2,
        max_lora_rank=32,
        max_cpu_loras=2,
        modules=[LoraModule("a", str(tmp_path / "a"))],
    )
    assert launch.frontend.enable_lora and not launch.frontend.enable_runtime_lora_updating
    assert [m.name for m in launch.frontend.lora_modules] == ["a"]
    assert build_plan(parse("m"), "/m", "/m").engine.lora is None


def test_vllms_environment_variable_turns_runtime_loading_on(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    launch = build_plan(parse("m", "--enable-lora"), "/m", "/m")
    assert launch.frontend.enable_runtime_lora_updating


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["--lora-modules", "a={adapter}"], "--lora-modules needs --enable-lora"),
        (["--enable-runtime-lora-updating"], "--enable-runtime-lora-updating needs --enable-lora"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "must be at least"),
        (["--enable-lora", "--max-lora-rank", "1024"], "above 512"),
        (["--enable-lora", "--lora-modules", "a={adapter}", "a={adapter}"], "given twice"),
        (["--enable-lora", "--lora-modules", "m={adapter}"], "a served model name"),
        (["--enable-lora", "--lora-modules", "a b={adapter}"], "only letters"),
        (["--enable-lora", "--lora-modules", "a={empty}"], "has no adapter_config.json"),
    ],
)
def test_bad_lora_flags_are_refused_before_anything_starts(tmp_path, argv, refusal):
    adapter, empty = write_adapter(tmp_path / "a"), tmp_path / "empty"
    empty.mkdir()
    argv = [a.format(adapter=adapter, empty=empty) for a in argv]
    assert refusal in plan.refuse_unsupported(parse("m", *argv))


def test_a_headless_engine_takes_the_heads_lora_settings():
    head = LoraConfig(max_loras=3, max_cpu_loras=4, modules=[LoraModule("a", "/adapters/a")])
    # The plan crosses the handshake socket intact.
    kind, sent = decode_handshake(encode_handshake("plan", engine_plan(["in"], ["out"], head)))
    assert kind == "plan" and sent.lora == head
    own = EngineConfig(model="/m", lora=LoraConfig(max_loras=1))
    proc = EngineCoreProc(
        EngineProcConfig(own, rank=1, handshake_address="tcp://h:1", headless=True)
    )
    proc.take_lora_settings(sent)
    assert proc.cfg.engine.lora == head
    proc.take_lora_settings(engine_plan(["in"], ["out"]))  # a head without LoRA: none here
    assert proc.cfg.engine.lora is None
    proc.ctx.destroy(linger=0)


def test_make_tiny_model_lora_writes_deterministic_peft_adapters(tiny_model, tmp_path):
    model = tiny_model("llama")
    one = build_tiny_lora(model, tmp_path / "one", seed=3, rank=4, targets="qv")
    two = build_tiny_lora(model, tmp_path / "two", seed=3, rank=4, targets="qv")
    other = build_tiny_lora(model, tmp_path / "other", seed=4, rank=4, targets="qv")
    weights = [(p / "adapter_model.safetensors").read_bytes() for p in (one, two, other)]
    assert weights[0] == weights[1] != weights[2]
    config = json.loads((one / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    with pytest.raises(FileExistsError):
        build_tiny_lora(model, one)


def test_the_command_adds_adapters_beside_an_existing_model(tiny_model, tmp_path, capsys):
    model = tiny_model("qwen2")
    args = argparse.Namespace(
        dir=model, arch="qwen2", size="tiny", force=False, lora=[tmp_path / "x", tmp_path / "y"],
        lora_rank=2, lora_alpha=4.0, lora_seed=0, lora_targets="all", lora_rslora=True,
    )  # fmt: skip
    assert run(args) == 0
    assert "rank-2 LoRA adapter" in capsys.readouterr().out
    for name in ("x", "y"):
        assert sorted(os.listdir(tmp_path / name)) == [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    assert json.loads((tmp_path / "y" / "adapter_config.json").read_text())["use_rslora"]
