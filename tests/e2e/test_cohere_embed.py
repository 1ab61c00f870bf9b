"""POST /v2/embed (Cohere's embed API, as vLLM serves it) through the `cohere` client
and raw HTTP: transformers' vectors for texts and inputs, an input_type's prompt from
the model's sentence-transformers config, Cohere's truncation and embedding types,
refusals naming the field; a maximal request leaves /health up."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from e2e_http import MAX_MODEL_LEN, MODEL, SERVED_NAMES, SMALL_KV, assert_error, post_while_probing
from hf_generate import reference_model
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(120)

PROMPTS = {"search_query": "query: ", "search_document": "", "classification": "classify: "}


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    """The tiny llama with sentence-transformers' prompts for three input types."""
    folder = tmp_path_factory.mktemp("cohere") / "llama"
    shutil.copytree(tiny_model("llama"), folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    return folder


@pytest.fixture(scope="module")
def server(model_dir):
    with ZServe(str(model_dir), *SERVED_NAMES, *SMALL_KV, "--runner", "pooling") as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def vector(model_dir):
    """Token ids → transformers' last hidden state, normalized."""
    model = reference_model(model_dir)

    def of(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            v = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].numpy()
        return v / np.linalg.norm(v)

    return of


def tokens(http, **body) -> list[int]:
    return http.post("/tokenize", json=body).json()["tokens"]


def test_the_cohere_client_gets_each_type_of_the_prompted_vectors(server, http, vector):
    import cohere

    client = cohere.ClientV2(base_url=server.base_url, api_key="none")
    texts = ["hello world", "def foo(x): return x"]
    result = client.embed(
        model=MODEL,
        texts=texts,
        input_type="search_query",
        embedding_types=["float", "binary", "ubinary", "base64"],
    )
    # The model has a chat template: the prompt is the system's message, the text the user's.
    ids = [
        tokens(http, messages=[{"role": "system", "content": "query: "},
                               {"role": "user", "content": t}], add_generation_prompt=False)
        for t in texts
    ]  # fmt: skip
    floats = np.array(result.embeddings.float_)
    for got, prompt in zip(floats, ids):
        np.testing.assert_allclose(got, vector(prompt), atol=1e-4)
    signs = np.packbits(floats >= 0, axis=-1)
    assert result.embeddings.ubinary == signs.tolist()
    assert result.embeddings.binary == (signs.astype(int) - 128).tolist()
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in result.embeddings.base64]
    np.testing.assert_allclose(decoded, floats, atol=1e-6)
    assert result.texts == texts and result.response_type == "embeddings_by_type"
    assert result.meta.billed_units.input_tokens == sum(map(len, ids))
    assert result.meta.api_version.version == "2"


def test_texts_inputs_empty_prompts_and_truncation(http, vector):
    text = "the quick brown fox jumps over the lazy dog"
    plain = tokens(http, prompt=text)
    # An empty prompt, or none asked for: the text alone, with the special tokens.
    for extra in ({}, {"input_type": "search_document"}):
        body = http.post("/v2/embed", json={"texts": [text], **extra}).json()
        np.testing.assert_allclose(body["embeddings"]["float"][0], vector(plain), atol=1e-4)
        assert set(body) == {"id", "embeddings", "texts", "meta", "response_type"}
    # inputs of text parts: the user's message, through the chat template.
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    body = http.post("/v2/embed", json={"inputs": [{"content": parts}]}).json()
    ids = tokens(http, messages=[{"role": "user", "content": parts}], add_generation_prompt=False)
    np.testing.assert_allclose(body["embeddings"]["float"][0], vector(ids), atol=1e-4)
    assert "texts" not in body and body["meta"]["billed_units"]["input_tokens"] == len(ids)
    # END keeps the first max_tokens tokens, START the last; NONE refuses a longer text.
    for truncate, kept in (("END", plain[:5]), ("START", plain[-5:])):
        body = {"texts": [text], "truncate": truncate, "max_tokens": 5}
        got = http.post("/v2/embed", json=body).json()["embeddings"]["float"][0]
        np.testing.assert_allclose(got, vector(kept), atol=1e-4)
    r = http.post("/v2/embed", json={"texts": [text], "truncate": "NONE", "max_tokens": 5})
    assert_error(r, 400, "max_tokens", ["exceeds max_tokens=5 with truncate=NONE"])
    assert http.post("/v2/embed", json={"texts": [text], "truncate": "NONE"}).status_code == 200
    long = {"texts": ["word " * MAX_MODEL_LEN], "truncate": "NONE"}
    assert_error(http.post("/v2/embed", json=long), 400, "input_tokens")
    cut = http.post("/v2/embed", json=long | {"truncate": "END"}).json()
    assert cut["meta"]["billed_units"]["input_tokens"] == MAX_MODEL_LEN


def test_refusals_name_the_field(http):
    cases = [
        ({"texts": ["a"], "input_type": "image"}, "input_type", "Supported values: classification"),
        ({"texts": ["a"], "output_dimension": 8}, "output_dimension", "Matryoshka"),
        ({"texts": ["a"], "embedding_types": ["int8"]}, "body.embedding_types.0", "'float'"),
        ({"texts": []}, "texts", "Exactly one of texts, images, or inputs"),
        ({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "b"}]}]}, "texts", ""),
        ({"images": ["data:image/png;base64,AA=="]}, "images", "text only"),
        ({"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None, "text only"),
        ({"texts": ["a"], "truncate": "MIDDLE"}, "body.truncate", "'END'"),
        ({"texts": ["a"], "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"texts": ["a"] * 1025}, "texts", "--max-prompts-per-request"),
        ({"texts": [""]}, "texts", "no tokens"),
    ]  # fmt: skip
    for body, param, text in cases:
        error = assert_error(http.post("/v2/embed", json=body), 400, contains=[text])
        if param is not None:
            assert error["param"] == param, (body, error)


def test_a_maximal_request_leaves_health_up(http):
    """--max-prompts-per-request texts filling the body, each cut to the context; and one
    input of as many text parts as the body holds (290k), cut to the context."""
    body = {"texts": ["word " * 1400] * 1024, "truncate": "END"}
    r = post_while_probing(http, "/v2/embed", body)
    assert r.status_code == 200 and len(r.json()["embeddings"]["float"]) == 1024
    parts = [{"type": "text", "text": "a"}] * 290_000
    r = post_while_probing(http, "/v2/embed", {"inputs": [{"content": parts}], "truncate": "END"})
    assert r.status_code == 200
    assert r.json()["meta"]["billed_units"]["input_tokens"] == MAX_MODEL_LEN
