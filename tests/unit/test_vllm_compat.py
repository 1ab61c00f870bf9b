"""vLLM's flags on zserve's command line: --generation-config and its override, the
--config YAML file, and the values refused with a reason (launcher/vllm_compat.py,
generation_config.py, config_file.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from launcher.cli import build_parser
from launcher.config_file import ConfigFileError, expand_config_file
from launcher.generation_config import GenerationConfigError, generation_defaults
from launcher.plan import LaunchRefused, plan_launch

pytestmark = pytest.mark.timeout(60)


def _model(tmp_path, config: dict | None):
    folder = tmp_path / "model"
    folder.mkdir()
    if config is not None:
        (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_auto_takes_the_models_values_that_differ_from_transformers_defaults(tmp_path):
    model = _model(
        tmp_path,
        {"temperature": 0.6, "top_k": 50, "top_p": 1.0, "min_p": 0.1, "max_new_tokens": 64,
         "presence_penalty": 0.5, "eos_token_id": 2, "do_sample": True},
    )  # fmt: skip
    got = generation_defaults("auto", model, {})
    # top_k 50 and top_p 1.0 are transformers' own defaults: vLLM's to_diff_dict drops them
    assert got.sampling == {
        "temperature": 0.6, "min_p": 0.1, "presence_penalty": 0.5, "max_tokens": 64,
    }  # fmt: skip
    assert got.max_tokens_ceiling is None  # the model's max_new_tokens is a default only
    with_override = generation_defaults("auto", model, {"top_k": 50, "max_new_tokens": 8})
    assert with_override.sampling["top_k"] == 50  # an override always counts
    assert with_override.max_tokens_ceiling == 8 == with_override.sampling["max_tokens"]


def test_vllm_ignores_the_model_and_a_folder_replaces_it(tmp_path):
    model = _model(tmp_path, {"temperature": 0.6})
    assert generation_defaults("vllm", model, {}).sampling == {}
    assert generation_defaults("vllm", model, {"top_p": 0.9}).sampling == {"top_p": 0.9}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 12}))
    folder = generation_defaults(str(other), model, {})
    assert folder.sampling == {"max_tokens": 12}
    assert folder.max_tokens_ceiling == 12  # vLLM: a folder's max_new_tokens caps requests
    bare = tmp_path / "bare"
    bare.mkdir()
    assert generation_defaults("auto", _model(bare, None), {}).sampling == {}  # no file: none


@pytest.mark.parametrize(
    ("source", "override", "message"),
    [
        ("{tmp}/missing", {}, "is not a folder"),
        ("{tmp}", {}, "no generation_config.json in"),
        ("vllm", {"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ("vllm", {"temperature": -1}, "temperature must be >= 0, got -1"),
        ("vllm", {"top_p": 0}, "top_p must be in (0, 1]"),
        ("vllm", {"top_k": 2.5}, "top_k must be an integer"),
        ("vllm", {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ("vllm", {"presence_penalty": True}, "presence_penalty must be a number"),
    ],
)
def test_bad_generation_configs_are_refused_with_the_reason(tmp_path, source, override, message):
    with pytest.raises(GenerationConfigError) as e:
        generation_defaults(source.format(tmp=tmp_path), str(tmp_path), override)
    assert message in str(e.value)


def test_a_bad_value_in_the_models_own_file_is_left_out_not_fatal(tmp_path, caplog):
    model = _model(tmp_path, {"temperature": "warm", "top_p": 0.5})
    assert generation_defaults("auto", model, {}).sampling == {"top_p": 0.5}
    assert "temperature must be a number, got 'warm'; not used as a default" in caplog.text
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": "warm"}))
    with pytest.raises(GenerationConfigError, match="temperature must be a number"):
        generation_defaults(str(other), model, {})  # a folder the operator named: fatal


def _serve_parser():
    return build_parser().subcommands["serve"]


def test_the_config_file_goes_before_the_command_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: /m\nport: 8123\nserved_model_name: [a, b]\nenable-prefix-caching: false\n"
        "enforce-eager: false\ndefault-chat-template-kwargs: {x: 1}\n"
    )
    argv = expand_config_file(["--config", str(config), "--port", "9"], _serve_parser())
    args = build_parser().parse_args(["serve", *argv])
    assert (args.model, args.port, args.served_model_name) == ("/m", 9, ["a", "b"])
    assert args.enable_prefix_caching is False and args.enforce_eager is False
    assert args.default_chat_template_kwargs == {"x": 1}
    # MODEL on the command line wins over the file's, and stays the positional
    argv = expand_config_file(["/cli", f"--config={config}"], _serve_parser())
    assert build_parser().parse_args(["serve", *argv]).model == "/cli"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus-flag: 1\n", "'bogus-flag' is not a flag of this command"),
        ("config: other.yaml\n", "cannot name another"),
        ("- a\n- b\n", "must hold a mapping"),
        ("port: [1\n", "not YAML"),
    ],
)
def test_bad_config_files_are_refused_with_the_reason(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(ConfigFileError) as e:
        expand_config_file(["--config", str(config)], _serve_parser())
    assert message in str(e.value)
    with pytest.raises(ConfigFileError, match="cannot be read"):
        expand_config_file(["--config", str(tmp_path / "none.yaml")], _serve_parser())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported"),
        (["--load-format", "pt"], "--load-format pt is not supported: zserve reads safetensors"),
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral is not supported"),
        (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not supported"),
        (["--chat-template-content-format", "openai"], "content-format openai is not supported"),
        (["--quantization", "fp8"], "--quantization fp8 is not supported"),
        (["-pp", "2"], "--pipeline-parallel-size 2 is not supported"),
        (["--distributed-executor-backend", "ray"], "--data-parallel-backend ray"),
        (["--fingerprint-mode", "custom"], "needs --fingerprint-value"),
        (["--fingerprint-value", "x"], "of --fingerprint-mode custom only"),
        (["--fingerprint-mode", "custom", "--fingerprint-value", "a\nb"], "printable"),
    ],
)
def test_vllm_values_zserve_cannot_honour_are_refused(flags, message):
    args = build_parser().parse_args(["serve", "/nonexistent", *flags])
    with pytest.raises(LaunchRefused) as e:
        plan_launch(args)
    assert message in str(e.value)


def test_model_may_be_a_flag_and_the_positional_wins(tiny_model, tmp_path, caplog):
    model = str(tiny_model("llama"))
    plan = plan_launch(build_parser().parse_args(["serve", "--model", model]))
    assert plan.frontend.model_dir == model and plan.engine.model == model
    other = tmp_path / "other"
    both = plan_launch(build_parser().parse_args(["serve", model, "--model", str(other)]))
    assert both.frontend.model_dir == model
    assert f"--model {other} is not used" in caplog.text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"messages": []}', "'messages' is not a template variable"),
        ('{"chat_template": "x"}', "'chat_template' is not a template variable"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_default_chat_template_kwargs_are_checked_as_parsed(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--default-chat-template-kwargs", value])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_hf_overrides_change_the_config_the_engine_reads(tiny_model):
    from engine_core.model_loader import inspect_model

    model = str(tiny_model("llama"))
    plain = inspect_model(model)
    info = inspect_model(model, {"max_position_embeddings": 256, "rms_norm_eps": 0.001})
    assert plain.max_position_embeddings != 256 and info.max_position_embeddings == 256
    assert info.hf_config.rms_norm_eps == 0.001 != plain.hf_config.rms_norm_eps
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel is not supported"):
        inspect_model(model, {"architectures": ["GPT2LMHeadModel"]})
    args = build_parser().parse_args(["serve", model, "--hf-overrides", '{"rms_norm_eps": 0.1}'])
    assert plan_launch(args).engine.hf_overrides == {"rms_norm_eps": 0.1}


def test_the_fingerprint_names_the_model_and_the_engines_numerics(tiny_model, tmp_path):
    """--fingerprint-mode as vLLM's: full and hash modes hash what decides the outputs
    (a restart keeps it; another dtype or model changes it); custom and none."""
    model = str(tiny_model("llama"))

    def fingerprint(*flags, model=model) -> str | None:
        return plan_launch(
            build_parser().parse_args(["serve", model, *flags])
        ).frontend.system_fingerprint

    full = fingerprint()
    assert full is not None and full.startswith("zserve-") and len(full.split("-")[-1]) == 8
    assert fingerprint() == full
    assert fingerprint("--max-num-seqs", "7") == full  # scheduling, not the outputs
    assert fingerprint("--dtype", "float32") != full
    assert fingerprint("--max-model-len", "512") != full
    other = tmp_path / "other"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    assert fingerprint(model=str(other)) != full
    dp = fingerprint("--data-parallel-size", "2")
    assert dp == full.replace("-" + full.split("-")[-1], "-dp2-" + full.split("-")[-1])
    assert fingerprint("--data-parallel-size", "2", "--fingerprint-mode", "hash") == full
    assert (
        fingerprint("--fingerprint-mode", "custom", "--fingerprint-value", "fleet-7") == "fleet-7"
    )
    assert fingerprint("--fingerprint-mode", "none") is None
    for flags in (["-pp", "1"], ["--distributed-executor-backend", "mp"], ["-cc", "{}"]):
        assert fingerprint(*flags) == full  # accepted vLLM flags that change nothing
