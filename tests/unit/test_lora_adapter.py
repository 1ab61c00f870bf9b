"""Reading a PEFT LoRA folder: what is served, and every refusal named (never a crash)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from lora_files import HIDDEN, KV, TARGETS, write_adapter

from engine_core.lora_adapter import LoraError, read_adapter


def test_an_adapter_reads_as_a_and_b_with_b_scaled_by_alpha_over_r(tmp_path):
    folder = write_adapter(tmp_path / "a")
    lora = read_adapter("a", str(folder), TARGETS, max_rank=8)
    assert lora.rank == 4 and set(lora.modules) == set(TARGETS)
    a, b = lora.modules["model.layers.0.self_attn.v_proj"]
    assert a.shape == (4, HIDDEN) and b.shape == (KV, 4) and a.dtype == torch.float32
    from safetensors.torch import load_file

    raw = load_file(str(folder / "adapter_model.safetensors"))
    torch.testing.assert_close(
        b, raw["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"] * 2
    )


def test_rslora_scales_by_alpha_over_the_square_root_of_r(tmp_path):
    folder = write_adapter(tmp_path / "a", {"use_rslora": True})
    lora = read_adapter("a", str(folder), TARGETS, max_rank=8)
    from safetensors.torch import load_file

    raw = load_file(str(folder / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(
        lora.modules["model.layers.0.mlp.down_proj"][1], b * 8 / math.sqrt(4)
    )


def test_the_digest_follows_the_bytes(tmp_path):
    one = read_adapter("a", str(write_adapter(tmp_path / "a")), TARGETS, 8)
    same = read_adapter("b", str(write_adapter(tmp_path / "b")), TARGETS, 8)
    other = read_adapter("c", str(write_adapter(tmp_path / "c", {"lora_alpha": 9})), TARGETS, 8)
    assert one.digest == same.digest != other.digest


def _refusal(tmp_path: Path, folder: Path | str, match: str, name: str = "a", max_rank: int = 8):
    with pytest.raises(LoraError, match=match):
        read_adapter(name, str(folder), TARGETS, max_rank)


def test_a_missing_folder_or_file_is_named(tmp_path):
    _refusal(tmp_path, tmp_path / "nowhere", "is not a folder on this machine")
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").unlink()
    _refusal(tmp_path, folder, "adapter_model.safetensors is missing")
    (folder / "adapter_config.json").unlink()
    _refusal(tmp_path, folder, "adapter_config.json is missing")


def test_a_pickled_adapter_is_never_loaded(tmp_path):
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    _refusal(tmp_path, folder, "adapter_model.bin is a pickle")


def test_a_rank_above_the_limit_is_refused_before_the_weights_are_read(tmp_path):
    folder = write_adapter(tmp_path / "a", rank=16)
    _refusal(tmp_path, folder, "rank 16 is above --max-lora-rank 8")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias 'all'"),
        ({"lora_bias": True}, "LoRA biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern"),
        ({"peft_type": "IA3"}, "not LoRA"),
        ({"r": 0}, "r must be a positive integer"),
        ({"r": "4"}, "r must be a positive integer"),
        ({"lora_alpha": "x"}, "lora_alpha must be a finite number"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false"),
    ],
)
def test_adapter_configs_zserve_does_not_serve_are_refused(tmp_path, config, match):
    _refusal(tmp_path, write_adapter(tmp_path / "a", config), match)


def test_a_config_that_is_not_a_json_object_is_refused(tmp_path):
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_config.json").write_text("[1, 2]")
    _refusal(tmp_path, folder, "must hold a JSON object")
    (folder / "adapter_config.json").write_text("{nope")
    _refusal(tmp_path, folder, "not valid JSON")
    (folder / "adapter_config.json").write_bytes(b"{" + b" " * (1 << 20) + b"}")
    _refusal(tmp_path, folder, "more than an adapter")


def test_shapes_the_base_does_not_have_are_named(tmp_path):
    g = torch.Generator().manual_seed(0)
    key = "base_model.model.model.layers.0.self_attn.v_proj"
    wrong = {f"{key}.lora_A.weight": torch.randn(4, HIDDEN, generator=g)}
    wrong[f"{key}.lora_B.weight"] = torch.randn(HIDDEN, 4, generator=g)  # v is KV wide
    _refusal(tmp_path, write_adapter(tmp_path / "a", tensors=wrong), r"and \(8, 4\) at rank 4")
    mismatched = {f"{key}.lora_A.weight": torch.randn(2, HIDDEN, generator=g)}
    mismatched[f"{key}.lora_B.weight"] = torch.randn(KV, 2, generator=g)
    _refusal(tmp_path, write_adapter(tmp_path / "b", tensors=mismatched), "at rank 4")


def test_modules_the_base_lacks_and_other_tensors_are_refused(tmp_path):
    t = torch.zeros(4, HIDDEN)
    absent = {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": t}
    _refusal(tmp_path, write_adapter(tmp_path / "a", tensors=absent), "no LoRA target")
    head = {"base_model.model.lm_head.lora_A.weight": t}
    _refusal(tmp_path, write_adapter(tmp_path / "b", tensors=head), "no LoRA target")
    embed = {"base_model.model.model.embed_tokens.lora_embedding_A": t}
    _refusal(tmp_path, write_adapter(tmp_path / "c", tensors=embed), "not a LoRA A/B weight")
    half = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": t}
    _refusal(tmp_path, write_adapter(tmp_path / "d", tensors=half), "has no lora_B weight")
    _refusal(tmp_path, write_adapter(tmp_path / "e", tensors={}), "holds no LoRA weights")


def test_non_finite_weights_are_refused(tmp_path):
    folder = write_adapter(tmp_path / "a")
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    next(iter(tensors.values()))[0, 0] = float("nan")
    _refusal(tmp_path, write_adapter(tmp_path / "b", tensors=tensors), "NaN or infinite")


def test_a_corrupt_or_oversized_weights_file_is_refused(tmp_path):
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    _refusal(tmp_path, folder, "not readable")
    with open(folder / "adapter_model.safetensors", "wb") as f:
        f.truncate(8 << 20)  # far more than any rank-8 adapter of this base
    _refusal(tmp_path, folder, "more than an adapter of this base model")


def test_special_files_are_never_opened_for_reading(tmp_path):
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").unlink()
    os.mkfifo(folder / "adapter_model.safetensors")  # a read would block forever
    _refusal(tmp_path, folder, "not a regular file")
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.safetensors").symlink_to("/dev/zero")
    _refusal(tmp_path, folder, "not a regular file")


@pytest.mark.parametrize(
    ("name", "path", "match"),
    [
        ("", "/x", "non-empty"),
        ("a" * 129, "/x", "at most 128"),
        ("-a", "/x", "start with a letter or digit"),
        ("a b", "/x", "only letters"),
        ("a\nb", "/x", "only letters"),
        ("a", "", "non-empty"),
        ("a", "/x\0y", "NUL"),
        ("a", "/" + "x" * 5000, "at most 4096"),
    ],
)
def test_names_and_paths_are_checked_before_the_file_system(tmp_path, name, path, match):
    _refusal(tmp_path, path, match, name=name)
