"""A sequence-classification model in the engine (EngineConfig.classifier): its score
head over the pooled state gives transformers' own logits, and their activation, on
every backend; an LLM as a reranker (classifier_from_token) gives its LM head's
preference; a checkpoint without a head is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_oracle import make_prompts
from hf_generate import reference_model
from test_pooling_engine import pool_all, pooling_engine
from tiny_classifier import build_classifier, reference_classifier

from engine_core.config import ClassifierConfig
from launcher.classifier_config import classifier_settings
from protocol.messages import PoolingParams

pytestmark = pytest.mark.timeout(180)

LENGTHS = (5, 1, 40, 90)


@pytest.fixture(scope="module")
def three_labels(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("cls") / "three"
    return build_classifier(tiny_model("llama"), out, ["neg", "neu", "pos"], seed=3)


def head_of(model_dir) -> ClassifierConfig:
    import json

    return classifier_settings(json.loads((model_dir / "config.json").read_text())).engine


def hf_logits(model_dir, prompts) -> list[np.ndarray]:
    model = reference_classifier(model_dir)
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts]


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_probabilities_are_transformers_logits_softmaxed(three_labels, impl):
    prompts = make_prompts(LENGTHS)
    head = head_of(three_labels)
    assert head.num_labels == 3 and head.activation == "softmax"
    # Steps of 32 tokens: the longer prompts end in a later chunk than they start.
    engine = pooling_engine(
        three_labels, model_impl=impl, max_num_batched_tokens=32, classifier=head
    )
    probs = pool_all(engine, prompts)
    logits = pool_all(engine, prompts, PoolingParams(use_activation=False))
    for p, raw, expected in zip(probs, logits, hf_logits(three_labels, prompts)):
        assert p.shape == (3,)
        np.testing.assert_allclose(raw, expected, atol=2e-5)
        np.testing.assert_allclose(p, torch.softmax(torch.tensor(expected), -1).numpy(), atol=1e-6)
    assert len({int(np.argmax(p)) for p in probs}) > 1  # the head tells prompts apart


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "phi3", "gemma2"])
def test_every_architectures_classifier(tiny_model, tmp_path, arch):
    # Each decoder's *ForSequenceClassification, on the backend auto picks for it.
    model_dir = build_classifier(tiny_model(arch), tmp_path / arch, ["x", "y"], seed=7)
    prompts = make_prompts((3, 20, 37))
    got = pool_all(pooling_engine(model_dir, classifier=head_of(model_dir)), prompts)
    for g, logits in zip(got, hf_logits(model_dir, prompts)):
        np.testing.assert_allclose(g, torch.softmax(torch.tensor(logits), -1).numpy(), atol=1e-5)


def test_one_label_is_a_sigmoid_and_a_regression_is_raw(tiny_model, tmp_path):
    base = tiny_model("llama")
    one = build_classifier(base, tmp_path / "one", ["relevant"], seed=5)
    regression = build_classifier(
        base, tmp_path / "reg", ["score"], seed=5, problem_type="regression"
    )
    prompts = make_prompts((7, 30))
    expected = hf_logits(one, prompts)
    assert head_of(one).activation == "sigmoid"
    got = pool_all(pooling_engine(one, classifier=head_of(one)), prompts)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, torch.sigmoid(torch.tensor(e)).numpy(), atol=1e-6)
    assert head_of(regression).activation == "identity"
    got = pool_all(pooling_engine(regression, classifier=head_of(regression)), prompts)
    for g, e in zip(got, expected):  # the same seed: the same head
        np.testing.assert_allclose(g, e, atol=2e-5)


def test_an_llm_as_reranker_scores_its_yes_against_its_no(tiny_model):
    base = tiny_model("llama")
    head = ClassifierConfig(
        num_labels=1, activation="sigmoid", from_tokens=("a", "b"), two_way=True
    )
    prompts = make_prompts((6, 50))
    got = pool_all(pooling_engine(base, classifier=head), prompts)
    from transformers import AutoTokenizer

    no, yes = AutoTokenizer.from_pretrained(base).convert_tokens_to_ids(["a", "b"])
    model = reference_model(base)
    for g, prompt in zip(got, prompts):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        expected = torch.softmax(logits[[no, yes]], -1)[1].item()  # the reranker's P(yes)
        assert g.shape == (1,) and abs(float(g[0]) - expected) < 1e-5


def test_a_checkpoint_without_a_head_and_dimensions_are_refused(tiny_model, three_labels):
    with pytest.raises(ValueError, match=r"score head \(score.weight\)"):
        pooling_engine(tiny_model("llama"), classifier=ClassifierConfig(num_labels=2))
    with pytest.raises(ValueError, match=r"score head of shape \(3, \d+\), expected \(2,"):
        pooling_engine(three_labels, classifier=ClassifierConfig(num_labels=2))
    engine = pooling_engine(three_labels, classifier=head_of(three_labels))
    from engine_oracle import request
    from test_pooling_engine import POOL

    (out,) = engine.add_request(request("d", [1, 2], POOL, pooling=PoolingParams(dimensions=2)))
    assert "has no dimensions" in out.error
