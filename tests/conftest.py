"""Fixtures shared by every test folder: random-weight models built offline by zserve's builder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from launcher.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model(arch)` gives the folder of a ~115k-parameter model, built once per arch."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(root / arch, arch=arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 19.7M-parameter benchmark llama; built on first use (trains a BPE, ~3 s)."""
    return build_tiny_model(tmp_path_factory.mktemp("small-model") / "small-llama", size="small")
