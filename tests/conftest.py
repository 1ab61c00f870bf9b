"""Fixtures shared by every test folder: random-weight models built offline by zserve's builder."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from httpx._transports import default as httpx_transports

from launcher.tiny_model import build_tiny_model


def _one_default_tls_context() -> None:
    """Every httpx client (every openai client's too) builds an SSL context when it is
    made, loading certifi's CA bundle into it: 17-30 ms of CPU each, ~2,500 times in a
    run (~80 s of a 2-core CI box), for servers that speak plain HTTP. The tests' clients
    with the default verification share one context instead; a client given its own
    context or certificate (the TLS tests) still gets exactly what it asks for."""
    build = httpx_transports.create_ssl_context
    shared = build()

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return shared
        return build(verify=verify, cert=cert, trust_env=trust_env)

    httpx_transports.create_ssl_context = create_ssl_context


_one_default_tls_context()


@pytest.fixture(scope="session", autouse=True)
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The logs of the servers the tests start (tests/zserve_proc.py) go in pytest's own
    temporary folder, which keeps the last three runs', instead of piling up in /tmp."""
    folder = tmp_path_factory.mktemp("server-logs")
    os.environ["ZSERVE_TEST_LOGS"] = str(folder)
    return folder


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


@pytest.fixture(scope="session")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, int], Path]:
    """`long_context(folder, positions)`: a copy of a model folder whose context is
    `positions` tokens (its RoPE needs no table), for streams that outlast a test's waits
    by construction instead of by a machine's speed."""

    def make(folder: Path, positions: int) -> Path:
        out = tmp_path_factory.mktemp("long-context") / folder.name
        shutil.copytree(folder, out)
        for name, key in (
            ("config.json", "max_position_embeddings"),
            ("tokenizer_config.json", "model_max_length"),
        ):
            path = out / name
            path.write_text(json.dumps({**json.loads(path.read_text()), key: positions}))
        return out

    return make
