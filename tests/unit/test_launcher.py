"""The launcher's decisions, without starting anything: refusals, CPU lists, engine
threads, and where a model's files are."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from launcher import arg_types, plan, serve_args
from launcher.models import ModelNotFoundError, resolve_model
from launcher.plan import cpu_share, engine_threads, refuse_unsupported


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zserve")
    serve_args.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["m", "--trust-remote-code"], ["--trust-remote-code is refused"]),
        (["m", "--tensor-parallel-size", "2"], ["--tensor-parallel-size 2 is not supported"]),
        (["m", "-dp", "2", "-dpl", "1"], ["--data-parallel-address", "--data-parallel-rpc-port"]),
        (["m", "--headless", "-dp", "2"], ["--headless needs --data-parallel-size-local"]),
        (["m", "--engine-cpus", "4096"], ["--engine-cpus", "[4096]", "not available"]),
    ],
)
def test_unsupported_combinations_are_refused_with_a_clear_message(argv, words):
    problem = refuse_unsupported(parse(*argv))
    assert problem is not None and all(w in problem for w in words), problem


def test_a_plain_serve_is_not_refused():
    assert refuse_unsupported(parse("m")) is None


def test_cpu_lists_and_even_shares():
    assert arg_types.cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    with pytest.raises(argparse.ArgumentTypeError):
        arg_types.cpu_list("a-b")
    assert cpu_share([2, 3, 4, 5], 1, 2) == [4, 5]
    assert cpu_share([1], 0, 2) == [1]  # too few to split: both share it
    assert cpu_share(None, 0, 2) is None


def test_engine_threads_leave_a_core_per_api_server_after_the_first(monkeypatch):
    monkeypatch.setattr(plan, "usable_cpus", lambda: list(range(8)))
    monkeypatch.setattr(plan, "usable_cores", lambda: 8)
    assert engine_threads(parse("m", "--api-server-count", "2"), local_engines=2) == 3
    assert engine_threads(parse("m", "--api-server-count", "3"), local_engines=1) == 6
    assert engine_threads(parse("m"), local_engines=1) == 8
    assert engine_threads(parse("m", "--headless"), local_engines=1) == 8
    assert engine_threads(parse("m", "--cpu-threads", "5"), local_engines=1) == 5
    assert engine_threads(parse("m", "--engine-cpus", "0-3"), local_engines=2) == 2
    monkeypatch.setattr(plan, "usable_cores", lambda: 2)
    assert engine_threads(parse("m", "--api-server-count", "4", "-dp", "2"), 2) == 1
    assert engine_threads(parse("m"), local_engines=1) == 2


def test_a_local_folder_resolves_to_its_absolute_path(tiny_model):
    folder = tiny_model("llama")
    assert resolve_model(str(folder)) == str(folder.resolve())


def test_a_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def _fake_hf_cache(root: Path, repo: str) -> Path:
    """The layout huggingface_hub keeps: refs/main names a snapshot folder."""
    base = root / f"models--{repo.replace('/', '--')}"
    snapshot = base / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("0" * 40)
    return snapshot


def test_a_cached_hugging_face_id_resolves_offline(tmp_path, monkeypatch):
    snapshot = _fake_hf_cache(tmp_path, "some-org/some-model")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert Path(resolve_model("some-org/some-model")) == snapshot


def test_an_uncached_id_is_a_clear_error_and_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model("some-org/not-here")


def test_help_never_prints_the_api_key_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("ZSERVE_API_KEY", "sk-secret-from-env")
    with pytest.raises(SystemExit):
        parse("--help")
    assert "sk-secret-from-env" not in capsys.readouterr().out
    assert parse("m").api_key is None  # read at start-up by the launch plan, never shown


def test_every_limit_flag_has_a_safe_default():
    args = parse("m")
    assert args.max_request_body_bytes == 8 << 20
    assert args.max_prompts_per_request == 1024
    assert args.max_sequences_per_request == 1024
    assert args.max_prompt_chars is None  # derived from max_model_len at run time
    assert args.header_read_timeout > 0 and args.body_read_timeout > 0
    assert parse("m", "--max-request-body-bytes", "1MiB").max_request_body_bytes == 1 << 20


def test_tokenizer_revision_picks_the_tokenizers_snapshot(tiny_model, tmp_path, monkeypatch):
    main = _fake_hf_cache(tmp_path, "some-org/tok")
    other = main.parent / ("1" * 40)
    other.mkdir()
    (other / "config.json").write_text("{}")
    (main.parent.parent / "refs" / "v2").write_text("1" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    model = str(tiny_model("llama"))
    args = parse(model, "--tokenizer", "some-org/tok", "--tokenizer-revision", "v2")
    assert Path(plan.plan_launch(args).frontend.tokenizer_dir) == other
    args = parse(model, "--tokenizer", "some-org/tok")
    assert Path(plan.plan_launch(args).frontend.tokenizer_dir) == main
