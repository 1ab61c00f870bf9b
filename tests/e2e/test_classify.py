"""A sequence-classification model behind --runner pooling (auto for a
*ForSequenceClassification checkpoint): /classify, /pooling and /invocations answer
transformers' own probabilities; a one-label model (a cross-encoder) scores /score and
/rerank pairs as the tokenizer joins them; an LLM as reranker (classifier_from_token)
scores its yes against its no; routes of other tasks are not served (the gRPC door's
Embed included); a maximal request leaves /health up and memory bounded."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import numpy as np
import pytest
import torch
from e2e_grpc import GRPCZServe
from e2e_http import (
    MAX_MODEL_LEN,
    MODEL,
    SERVED_NAMES,
    SMALL_KV,
    assert_error,
    assert_memory_returns,
    post_while_probing,
    rss,
)
from hf_generate import reference_model
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated.vllm_engine_pb2_grpc import VllmEngineStub
from tiny_classifier import build_classifier, reference_classifier
from transformers import AutoTokenizer
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(120)

LABELS = ["neg", "neu", "pos"]
TEXTS = ["hello world", "def foo(x):\n    return x", "a", "the quick brown fox"]
QUERY = "what is a fox"
DOCS = ["the quick brown fox", "def foo(x): pass", "foxes are small canids", "x"]


@pytest.fixture(scope="module")
def classifier(tiny_model, tmp_path_factory):
    return build_classifier(tiny_model("llama"), tmp_path_factory.mktemp("cls") / "c", LABELS, 3)


@pytest.fixture(scope="module")
def cross_encoder(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("cls") / "ce"
    return build_classifier(tiny_model("llama"), out, ["relevant"], 4, separator="<|endoftext|>")


def serve(model_dir, *flags):
    return ZServe(str(model_dir), *SERVED_NAMES, *SMALL_KV, "--enable-dev-routes", *flags)


@pytest.fixture(scope="module")
def server(classifier):
    with serve(classifier) as s:  # no --runner: the architecture says it pools
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ce_server(cross_encoder):
    with serve(cross_encoder, "--runner", "pooling", "--api-server-count", "2") as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def ce(ce_server):
    with httpx.Client(base_url=ce_server.base_url, timeout=120) as c:
        yield c


def logits_of(model_dir, prompts: list[list[int]]) -> list[np.ndarray]:
    model = reference_classifier(model_dir)
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts]


def ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_classify_answers_transformers_probabilities_and_the_likeliest_label(
    server, http, classifier
):
    r = http.post("/classify", json={"model": MODEL, "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    assert body["model"] == MODEL
    prompts = [ids(http, t) for t in TEXTS]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, prompts))
    for i, (item, logits) in enumerate(zip(body["data"], logits_of(classifier, prompts))):
        probs = torch.softmax(torch.tensor(logits), -1).numpy()
        assert item["index"] == i and item["num_classes"] == 3
        np.testing.assert_allclose(item["probs"], probs, atol=1e-5)
        assert item["label"] == LABELS[int(np.argmax(probs))]
    assert len({item["label"] for item in body["data"]}) > 1
    # use_activation false: the logits themselves; token ids and a conversation too.
    raw = http.post("/classify", json={"input": [prompts[0]], "use_activation": False}).json()
    np.testing.assert_allclose(
        raw["data"][0]["probs"], logits_of(classifier, prompts[:1])[0], atol=2e-5
    )
    messages = [{"role": "user", "content": "hi there"}]
    chat_ids = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    r = http.post("/classify", json={"messages": messages})
    expected = torch.softmax(
        torch.tensor(logits_of(classifier, [chat_ids.json()["tokens"]])[0]), -1
    )
    np.testing.assert_allclose(r.json()["data"][0]["probs"], expected.numpy(), atol=1e-5)


def test_pooling_and_invocations_classify_too(http):
    expected = http.post("/classify", json={"input": TEXTS[:2]}).json()["data"]
    pooled = http.post("/pooling", json={"input": TEXTS[:2]}).json()
    assert pooled["id"].startswith("pooling-")
    # (Equal to float32 rounding: a step's batch may differ from the other request's.)
    probs = [d["probs"] for d in expected]
    np.testing.assert_allclose([d["data"] for d in pooled["data"]], probs, atol=1e-6)
    assert http.post("/pooling", json={"input": TEXTS[:2], "task": "classify"}).status_code == 200
    invoked = http.post("/invocations", json={"input": TEXTS[:2]}).json()
    assert [(d["label"], d["num_classes"]) for d in invoked["data"]] == [
        (d["label"], d["num_classes"]) for d in expected
    ]
    np.testing.assert_allclose([d["probs"] for d in invoked["data"]], probs, atol=1e-6)


def test_other_tasks_routes_are_not_served_and_refusals_name_the_field(server, http):
    for path in ("/v1/embeddings", "/score", "/rerank", "/v1/completions", "/v1/chat/completions"):
        assert_error(http.post(path, json={"input": "a", "queries": "a", "documents": ["b"]}), 404)
    assert "/classify" in http.get("/openapi.json").json()["paths"]
    for body, param, words in (
        ({"input": "a", "task": "embed"}, "task", "this model's task is 'classify'"),
        ({"input": "a", "dimensions": 2}, "dimensions", "does not support Matryoshka"),
        ({"input": []}, "input", "at least one prompt"),
        ({"input": [[1] * (MAX_MODEL_LEN + 1)]}, "input_tokens", "maximum context length"),
        ({"input": "a", "messages": [{"role": "user", "content": "b"}]}, None, "exactly one"),
        ({"input": [{"x": 1}]}, None, ""),
    ):
        r = http.post("/pooling", json=body)
        assert_error(r, 400, contains=[words])
        if param:
            assert r.json()["error"]["param"] == param
    assert_error(http.post("/classify", json={"input": "a", "use_activation": 3}), 400)
    fit = http.post("/classify", json={"input": [[1] * MAX_MODEL_LEN]})  # a full context fits
    assert fit.status_code == 200, fit.text


def test_a_cross_encoder_scores_pairs_as_the_tokenizer_joins_them(ce, cross_encoder):
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    pairs = [tokenizer(QUERY, text_pair=d)["input_ids"] for d in DOCS]
    assert all(p.count(tokenizer.convert_tokens_to_ids("<|endoftext|>")) == 1 for p in pairs)
    expected = [float(torch.sigmoid(torch.tensor(x[0]))) for x in logits_of(cross_encoder, pairs)]
    scores = ce.post("/score", json={"queries": QUERY, "documents": DOCS}).json()
    assert [d["index"] for d in scores["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["score"] for d in scores["data"]], expected, atol=1e-5)
    assert scores["usage"]["prompt_tokens"] == sum(map(len, pairs))
    # N:N under vLLM's other names, and the raw logit without the activation.
    for a, b in (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "items")):
        got = ce.post("/v1/score", json={a: [QUERY] * 4, b: DOCS}).json()["data"]
        np.testing.assert_allclose([d["score"] for d in got], expected, atol=1e-5)
    raw = ce.post("/score", json={"queries": QUERY, "documents": DOCS[:1], "use_activation": False})
    logit = logits_of(cross_encoder, pairs[:1])[0][0]
    assert abs(raw.json()["data"][0]["score"] - float(logit)) < 2e-5
    # /rerank: best first, top_n; /classify: the one label's probability.
    ranked = ce.post("/v2/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    order = list(np.argsort(expected)[::-1][:2])
    assert [r["index"] for r in ranked["results"]] == order
    assert ranked["results"][0]["document"]["text"] == DOCS[order[0]]
    one = ce.post("/classify", json={"input": "a"}).json()["data"][0]
    assert one["num_classes"] == 1 and one["label"] == "relevant"


def test_a_cross_encoder_cuts_each_side_to_its_first_tokens(ce, cross_encoder):
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    doc = "the quick brown fox jumps over the lazy dog " * 3
    body = {"query": QUERY, "documents": [doc], "max_tokens_per_doc": 3, "max_tokens_per_query": 2}
    got = ce.post("/rerank", json=body).json()["results"][0]["relevance_score"]

    def first(text: str, n: int) -> str:
        return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:n])

    pair = tokenizer(first(QUERY, 2), text_pair=first(doc, 3))["input_ids"]
    expected = float(torch.sigmoid(torch.tensor(logits_of(cross_encoder, [pair])[0][0])))
    assert abs(got - expected) < 1e-5
    too_long = {"query": QUERY, "documents": ["word " * 2000]}
    assert_error(ce.post("/rerank", json=too_long), 400, contains=["maximum context length"])
    cut = ce.post("/rerank", json=too_long | {"truncate_prompt_tokens": 16}).json()
    assert cut["usage"]["prompt_tokens"] == 16


def test_an_llm_as_reranker_scores_its_yes_against_its_no(tiny_model):
    model_dir = tiny_model("llama")
    overrides = {"classifier_from_token": ["a", "b"], "method": "from_2_way_softmax"}
    flags = ("--convert", "classify", "--hf-overrides", json.dumps(overrides))
    with serve(model_dir, *flags) as s, httpx.Client(base_url=s.base_url, timeout=60) as c:
        got = c.post("/score", json={"queries": QUERY, "documents": DOCS[:2]}).json()["data"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    no, yes = tokenizer.convert_tokens_to_ids(["a", "b"])
    model = reference_model(model_dir)
    for item, doc in zip(got, DOCS[:2]):
        prompt = tokenizer(QUERY + doc)["input_ids"]  # one text: no separator between
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        assert abs(item["score"] - torch.softmax(logits[[no, yes]], -1)[1].item()) < 1e-5


def test_a_chat_template_renders_each_pair_as_query_and_document(cross_encoder, tmp_path):
    template = tmp_path / "score.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if instruction %}<i>{{ instruction }}</i>{% endif %}"
    )
    body = {"queries": QUERY, "documents": DOCS[:2], "instruction": "judge"}
    with serve(cross_encoder, "--chat-template", str(template)) as s:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            got = c.post("/score", json=body).json()["data"]
            reserved = c.post("/score", json=body | {"chat_template_kwargs": {"tokenize": 1}})
    assert_error(reserved, 400, "chat_template_kwargs")
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    texts = [f"<query>{QUERY}</query><document>{d}</document><i>judge</i>" for d in DOCS[:2]]
    logits = logits_of(cross_encoder, [tokenizer(t)["input_ids"] for t in texts])
    for item, x in zip(got, logits):
        assert abs(item["score"] - float(torch.sigmoid(torch.tensor(x[0])))) < 1e-5


def test_a_maximal_rerank_leaves_health_up_and_memory_bounded(ce_server, ce):
    """--max-prompts-per-request texts filling the body, each document cut to 4 tokens:
    1023 pairs in the engine; the probes answer throughout, the KV cache is empty after,
    memory comes back."""
    ce.post("/rerank", json={"query": "warm", "documents": ["up"]})
    time.sleep(2)
    baseline = rss(ce_server)
    text = "word " * 1600
    body = {"query": text, "documents": [text] * 1023, "max_tokens_per_doc": 4,
            "max_tokens_per_query": 4}  # fmt: skip
    r = post_while_probing(ce, "/rerank", body)
    assert r.status_code == 200 and len(r.json()["results"]) == 1023
    stats = httpx.get(ce_server.base_url + "/server_info").json()["engines"][0]["stats"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert_memory_returns(ce_server, baseline)


def test_the_grpc_door_of_a_classifier_refuses_embed_and_names_classify(classifier):
    """The gRPC proto has no classify RPC: Embed on a classifier is UNIMPLEMENTED and
    says where classification is served, and the model info says it does not generate."""
    with GRPCZServe(str(classifier), *SERVED_NAMES, *SMALL_KV) as worker:
        with worker.channel() as channel:
            stub = VllmEngineStub(channel)
            request = pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[72, 101, 108]))
            with pytest.raises(grpc.RpcError) as refused:
                stub.Embed(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "/classify" in refused.value.details()
            assert not stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).is_generation
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
        log = worker.log()
    assert "Traceback" not in log, log[-4000:]
