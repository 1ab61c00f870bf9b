"""--runner pooling, --convert and --pooler-config: what the engines and API servers
are given, the model's sentence-transformers files read as vLLM reads them, and the
values refused with the reason (launcher/pooling_flags.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from launcher.cli import build_parser
from launcher.plan import LaunchRefused, plan_launch

pytestmark = pytest.mark.timeout(60)


def plan(model, *flags):
    return plan_launch(build_parser().parse_args(["serve", str(model), *flags]))


@pytest.fixture
def st_model(tiny_model, tmp_path):
    """A copy of the tiny llama with sentence-transformers files; write_modules(...)
    sets them."""
    folder = tmp_path / "st"
    shutil.copytree(tiny_model("llama"), folder)

    def write_modules(*types: str, pooling: dict | None = None):
        modules = [
            {"idx": i, "name": str(i), "path": f"{i}_x", "type": t} for i, t in enumerate(types)
        ]
        (folder / "modules.json").write_text(json.dumps(modules))
        for i, t in enumerate(types):
            if t.endswith("Pooling") and pooling is not None:
                (folder / f"{i}_x").mkdir(exist_ok=True)
                (folder / f"{i}_x" / "config.json").write_text(json.dumps(pooling))
        return folder

    return write_modules


def test_pooling_runner_defaults_to_last_normalized(tiny_model):
    for flags in (["--runner", "pooling"], ["--convert", "embed"]):
        p = plan(tiny_model("llama"), *flags)
        assert (p.engine.runner, p.engine.pooling_type) == ("pooling", "LAST")
        assert p.frontend.pooling.normalize is True and p.frontend.pooling.matryoshka is False
    p = plan(tiny_model("llama"))
    assert p.engine.runner == "generate" and p.frontend.pooling is None


def test_pooler_config_then_sentence_transformers_then_defaults(st_model):
    st = "sentence_transformers.models."
    folder = st_model(st + "Transformer", st + "Pooling", st + "Normalize",
                      pooling={"pooling_mode_cls_token": True})  # fmt: skip
    p = plan(folder, "--runner", "pooling")
    assert p.engine.pooling_type == "CLS" and p.frontend.pooling.normalize is True
    p = plan(folder, "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}')
    assert p.engine.pooling_type == "MEAN"
    # Newer sentence-transformers name one mode; no Normalize module: not normalized.
    folder = st_model(st + "Transformer", st + "Pooling", pooling={"pooling_mode": "lasttoken"})
    p = plan(folder, "--runner", "pooling")
    assert p.engine.pooling_type == "LAST" and p.frontend.pooling.normalize is False
    p = plan(folder, "--runner", "pooling", "--pooler-config", '{"use_activation": true}')
    assert p.frontend.pooling.normalize is True


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--convert", "classify"], "has no score head (score.weight)"),
        (["--convert", "reward"], "--convert reward is not supported"),
        (["--runner", "generate", "--convert", "embed"], "use it with --runner pooling"),
        (["--pooler-config", '{"pooling_type": "MEAN"}'], "--pooler-config needs --runner pooling"),
        (["--runner", "pooling", "--convert", "none"], "has no pooler of its own"),
        (["--runner", "pooling", "--pooler-config", '{"normalize": true}'], "use `use_activation`"),
        (
            ["--runner", "pooling", "--pooler-config", '{"pooling_type": "ALL"}'],
            "'ALL' is not supported",
        ),
        (["--runner", "pooling", "--pooler-config", '{"step_tag_id": 3}'], "not reward scores"),
        (["--runner", "pooling", "--pooler-config", '{"bogus": 1}'], "unknown key 'bogus'"),
        (["--runner", "pooling", "--pooler-config", '{"use_activation": 1}'], "true or false"),
    ],
)
def test_what_zserve_cannot_pool_is_refused(tiny_model, flags, message):
    with pytest.raises(LaunchRefused) as e:
        plan(tiny_model("llama"), *flags)
    assert message in str(e.value)


def test_a_projection_or_unknown_pooling_of_the_model_is_refused(st_model):
    st = "sentence_transformers.models."
    with pytest.raises(LaunchRefused, match="Dense module"):
        plan(st_model(st + "Transformer", st + "Pooling", st + "Dense"), "--runner", "pooling")
    folder = st_model(st + "Pooling", pooling={"pooling_mode_max_tokens": True})
    with pytest.raises(LaunchRefused, match="pooling 'max_tokens' is not supported"):
        plan(folder, "--runner", "pooling")
