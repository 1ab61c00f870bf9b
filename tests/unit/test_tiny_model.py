"""The offline model builder: deterministic, atomic, loadable by transformers, byte-exact tokens."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import launcher.tiny_model as tiny_model_module
from launcher.tiny_model import (
    ARCHS,
    add_parser,
    build_tiny_model,
    default_model_dir,
    ensure_default_model,
)

SYSTEM_AND_USER = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "héllo ✓"},
]
CHATML = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo ✓<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tiny_model("llama"))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def parameter_count(folder: Path) -> int:
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    return sum(math.prod(tensor["shape"]) for tensor in header.values())


def greedy(model, prompt: str, new_tokens: int = 24) -> list[int]:
    import torch

    input_ids = torch.tensor([list(prompt.encode())])
    generated = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        do_sample=False,
    )
    return generated[0, input_ids.shape[1] :].tolist()


def hidden_entries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


@pytest.mark.timeout(60)
def test_two_builds_of_the_same_model_are_byte_identical(tiny_model, tmp_path):
    first = tiny_model("llama")
    second = build_tiny_model(tmp_path / "again", arch="llama")

    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_loads_and_generates_varied_greedy_text_with_transformers(tiny_model, arch):
    from hf_generate import reference_model

    model = reference_model(tiny_model(arch))
    assert model.config.model_type == arch
    assert parameter_count(tiny_model(arch)) == pytest.approx(115_000, rel=0.01)

    prompts = ["Hello, world", "def fib(n):", "你好"]
    outputs = [tuple(greedy(model, prompt, new_tokens=16)) for prompt in prompts]
    assert all(len(set(output)) > 1 for output in outputs), outputs
    assert len(set(outputs)) == len(outputs), outputs


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("arch", "feature_off"),
    [
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"query_pre_attn_scalar": 16}),
        ("gemma2", {"sliding_window": 4096}),
        ("mistral", {"sliding_window": 4096}),
    ],
)
def test_an_engine_that_ignores_the_variant_feature_gets_other_greedy_tokens(
    tiny_model, arch, feature_off
):
    from hf_generate import reference_model

    prompt = "The quick brown fox jumps over the lazy dog"  # longer than the sliding window
    faithful = reference_model(tiny_model(arch))
    ignoring = reference_model(tiny_model(arch), **feature_off)
    assert greedy(faithful, prompt) != greedy(ignoring, prompt)


def test_each_arch_variant_carries_the_feature_it_exists_to_test(tiny_model):
    config = {arch: read_json(tiny_model(arch) / "config.json") for arch in ARCHS}

    assert config["qwen3"]["head_dim"] == 16
    assert config["mistral"]["sliding_window"] == 16
    gemma2 = config["gemma2"]
    assert gemma2["attn_logit_softcapping"] == 2.0
    assert gemma2["final_logit_softcapping"] is not None
    assert gemma2["layer_types"] == ["sliding_attention", "full_attention"]
    assert gemma2["sliding_window"] < 1024
    assert gemma2["query_pre_attn_scalar"] != gemma2["head_dim"]
    for arch, c in config.items():
        assert (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]) == (320, 64, 2), arch
        assert (c["num_attention_heads"], c["num_key_value_heads"]) == (4, 2), arch
        assert c["tie_word_embeddings"] is False, arch


@pytest.mark.timeout(60)
def test_qwen2_variant_has_qkv_bias(tiny_model):
    from safetensors import safe_open

    with safe_open(tiny_model("qwen2") / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


def test_byte_tokenizer_round_trips_multibyte_text_one_token_per_byte(tokenizer):
    text = "héllo wörld ✓ 你好"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_byte_tokenizer_round_trips_arbitrary_unicode(tokenizer, text):
    assume("<|" not in text)  # special tokens are matched whole, by design
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_special_token_ids_are_pad_256_im_start_257_eos_258(tiny_model, tokenizer):
    assert tokenizer.pad_token_id == 256
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 257
    assert tokenizer.eos_token_id == 258
    assert tokenizer.bos_token_id is None
    assert len(tokenizer) == 259
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [257, *b"user", 258]
    generation = read_json(tiny_model("llama") / "generation_config.json")
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (258, 256)


def test_chat_template_renders_chatml_with_and_without_generation_prompt(tokenizer):
    without = tokenizer.apply_chat_template(SYSTEM_AND_USER, tokenize=False)
    with_prompt = tokenizer.apply_chat_template(
        SYSTEM_AND_USER, tokenize=False, add_generation_prompt=True
    )
    assert without == CHATML
    assert with_prompt == CHATML + "<|im_start|>assistant\n"


def test_chat_template_joins_list_of_text_parts_like_string_content(tokenizer):
    parts = [
        SYSTEM_AND_USER[0],
        {
            "role": "user",
            "content": [{"type": "text", "text": "hél"}, {"type": "text", "text": "lo ✓"}],
        },
    ]
    rendered = tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    assert rendered == CHATML + "<|im_start|>assistant\n"


def test_chat_template_closes_an_empty_think_block_when_enable_thinking_is_false(tokenizer):
    def render(**kwargs) -> str:
        return tokenizer.apply_chat_template(
            SYSTEM_AND_USER, tokenize=False, add_generation_prompt=True, **kwargs
        )

    assert render(enable_thinking=False) == render() + "<think>\n\n</think>\n\n"
    assert render(enable_thinking=True) == render()


def test_chat_template_is_saved_for_transformers_5_and_for_older_loaders(tiny_model):
    folder = tiny_model("llama")
    tokenizer_config = read_json(folder / "tokenizer_config.json")
    assert tokenizer_config["chat_template"] == (folder / "chat_template.jinja").read_text()
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert read_json(folder / "special_tokens_map.json")["eos_token"] == "<|im_end|>"


def test_existing_folder_is_refused_without_force_and_replaced_with_it(tiny_model, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    with pytest.raises(FileExistsError, match="--force"):
        build_tiny_model(out)
    assert (out / "keep.txt").read_text() == "mine"

    build_tiny_model(out, force=True)
    assert not (out / "keep.txt").exists()
    assert (out / "model.safetensors").read_bytes() == (
        tiny_model("llama") / "model.safetensors"
    ).read_bytes()
    assert hidden_entries(tmp_path) == []


def test_failed_build_leaves_neither_the_folder_nor_its_staging_area(tmp_path, monkeypatch):
    def fail(*args):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(tiny_model_module, "_add_legacy_fields", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        build_tiny_model(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_builder_that_loses_a_race_leaves_the_winners_folder_alone(tmp_path, monkeypatch):
    out = tmp_path / "model"
    finish = tiny_model_module._add_legacy_fields

    def finish_while_another_builder_wins(folder, recipe):
        finish(folder, recipe)
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_model_module, "_add_legacy_fields", finish_while_another_builder_wins)
    with pytest.raises(FileExistsError):
        build_tiny_model(out)
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert hidden_entries(tmp_path) == []


def test_default_model_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "zserve" / "models" / "small-llama"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home" / ".cache" / "zserve" / "models" / "small-llama"


def test_default_model_is_built_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def build_tiny_instead(out, arch, size):
        calls.append((arch, size))
        return build_tiny_model(out, arch=arch)

    monkeypatch.setattr(tiny_model_module, "build_tiny_model", build_tiny_instead)
    first = ensure_default_model()
    second = ensure_default_model()

    assert first == second == default_model_dir()
    assert (first / "config.json").is_file()
    assert calls == [("llama", "small")]


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["make-tiny-model", *argv])
    return args.run(args)


def test_cli_builds_the_requested_arch_and_says_the_weights_are_random(tmp_path, capsys):
    out = tmp_path / "qwen3"
    assert run_cli(str(out), "--arch", "qwen3") == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "random" in printed
    assert read_json(out / "config.json")["model_type"] == "qwen3"

    assert run_cli(str(out), "--arch", "qwen3") == 2
    assert "--force" in capsys.readouterr().err
    assert run_cli(str(out), "--arch", "qwen3", "--force") == 0


def test_cli_refuses_a_small_model_of_another_arch(tmp_path, capsys):
    assert run_cli(str(tmp_path / "m"), "--arch", "qwen3", "--size", "small") == 2
    assert "llama" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_small_model_has_the_benchmark_shape_and_a_bos_chatml_template(small_model):
    from transformers import PreTrainedTokenizerFast

    config = read_json(small_model / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    shape = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
    assert shape == {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408}
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (4, 8)
    assert (config["head_dim"], config["num_key_value_heads"]) == (64, 2)
    assert (config["rope_theta"], config["torch_dtype"]) == (10000.0, "bfloat16")
    assert parameter_count(small_model) == 19_665_408
    generation = read_json(small_model / "generation_config.json")
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, [2, 4])
    assert generation["pad_token_id"] == 0

    tokenizer = PreTrainedTokenizerFast.from_pretrained(small_model)
    assert len(tokenizer) == 8192
    ids = tokenizer.encode("def fib(n):")
    assert ids[0] == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "def fib(n):"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert read_json(small_model / "tokenizer_config.json")["add_bos_token"] is True


@pytest.mark.timeout(60)
def test_importing_the_builder_leaves_torch_and_transformers_unimported():
    code = (
        "import sys, launcher.tiny_model; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'tokenizers'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
