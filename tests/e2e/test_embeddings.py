"""--runner pooling: /v1/embeddings and /pooling through the official client and raw
HTTP, against transformers' own hidden states; vLLM's formats, defaults and refusals;
the generation routes gone; a maximal request leaves /health up and memory bounded."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch
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
from zserve_proc import ZServe, wait_for

from frontend.app import served_routes
from frontend.config import FrontendConfig, PoolingOptions
from launcher.tiny_lora import build_tiny_lora

pytestmark = pytest.mark.timeout(120)

TEXTS = ["hello world", "def foo(x):\n    return x", "a"]


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return build_tiny_lora(tiny_model("llama"), tmp_path_factory.mktemp("lora") / "a", seed=1)


@pytest.fixture(scope="module")
def server(tiny_model, adapter):
    flags = ("--runner", "pooling", "--api-server-count", "2", "--enable-dev-routes",
             "--enable-lora", "--lora-modules", f"a={adapter}")  # fmt: skip
    with ZServe(str(tiny_model("llama")), *SERVED_NAMES, *SMALL_KV, *flags) as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hidden(tiny_model):
    """Token ids → transformers' final hidden states (after the model's last norm)."""
    model = reference_model(tiny_model("llama"))

    def of(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()

    return of


def tokens(http, **body) -> list[int]:
    return http.post("/tokenize", json=body).json()["tokens"]


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_the_official_client_gets_the_last_tokens_normalized_hidden_states(server, http, hidden):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    # Left to itself the client asks for base64 and decodes it; floats too.
    for fmt in ({}, {"encoding_format": "float"}):
        result = client.embeddings.create(model=MODEL, input=TEXTS, **fmt)
        assert [d.index for d in result.data] == [0, 1, 2]
        ids = [tokens(http, prompt=t) for t in TEXTS]
        assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
        for d, prompt in zip(result.data, ids):
            np.testing.assert_allclose(d.embedding, unit(hidden(prompt)[-1]), atol=1e-4)
    assert result.model == MODEL and result.object == "list"


def test_token_ids_conversations_and_truncation(http, hidden):
    prompt = [5, 6, 7, 8, 9, 10]
    by_ids = http.post("/v1/embeddings", json={"input": [prompt, prompt[:3]]}).json()
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], unit(hidden(prompt)[-1]), atol=1e-4)
    np.testing.assert_allclose(
        by_ids["data"][1]["embedding"], unit(hidden(prompt[:3])[-1]), atol=1e-4
    )
    # A conversation: its chat template's text (no generation prompt), no extra specials.
    messages = [{"role": "user", "content": "hi there"}]
    ids = tokens(http, messages=messages, add_generation_prompt=False)
    for body in ({"messages": messages}, {"input": messages}, {"messages": [messages] * 2}):
        data = http.post("/v1/embeddings", json=body).json()["data"]
        np.testing.assert_allclose(data[-1]["embedding"], unit(hidden(ids)[-1]), atol=1e-4)
    # truncate_prompt_tokens keeps the first tokens by default (vLLM's for pooling).
    cut = {"input": [prompt], "truncate_prompt_tokens": 2}
    first = http.post("/v1/embeddings", json=cut).json()["data"][0]["embedding"]
    np.testing.assert_allclose(first, unit(hidden(prompt[:2])[-1]), atol=1e-4)
    last = http.post("/v1/embeddings", json=cut | {"truncation_side": "left"}).json()
    np.testing.assert_allclose(
        last["data"][0]["embedding"], unit(hidden(prompt[-2:])[-1]), atol=1e-4
    )
    assert last["usage"]["prompt_tokens"] == 2


def test_encodings_dtypes_byte_orders_and_no_normalization(http, hidden):
    prompt = [40, 41, 42]
    expected = unit(hidden(prompt)[-1]).astype(np.float32)
    body = {"input": [prompt], "encoding_format": "base64"}
    for dtype, endianness, numpy_type in (
        ("float32", "native", "<f4"),
        ("float32", "big", ">f4"),
        ("float16", "little", "<f2"),
    ):
        r = http.post(
            "/v1/embeddings", json=body | {"embed_dtype": dtype, "endianness": endianness}
        )
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        np.testing.assert_allclose(np.frombuffer(raw, numpy_type), expected, atol=2e-3)
    r = http.post("/v1/embeddings", json=body | {"embed_dtype": "bfloat16"})
    top = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<u2")
    np.testing.assert_allclose((top.astype(np.uint32) << 16).view("<f4"), expected, atol=1e-2)
    # bytes: the vectors back to back, where each lies in the metadata header.
    r = http.post("/v1/embeddings", json={"input": [prompt, prompt], "encoding_format": "bytes"})
    assert r.headers["content-type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    assert [(d["start"], d["end"], d["shape"]) for d in meta["data"]] == [
        (0, 4 * len(expected), [len(expected)]),
        (4 * len(expected), 8 * len(expected), [len(expected)]),
    ]
    assert meta["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    np.testing.assert_allclose(
        np.frombuffer(r.content, "<f4")[: len(expected)], expected, atol=1e-4
    )
    # The header is ASCII whatever the client's id holds (the fuzz property found it).
    body = {"input": [prompt], "encoding_format": "bytes", "request_id": "\u0100\n"}
    r = http.post("/v1/embeddings", json=body)
    assert json.loads(r.headers["metadata"])["id"] == "embd-\u0100\n"
    r = http.post("/v1/embeddings", json={"input": [prompt], "encoding_format": "bytes_only"})
    assert "metadata" not in r.headers and len(r.content) == 4 * len(expected)
    raw = http.post("/v1/embeddings", json={"input": [prompt], "use_activation": False}).json()
    np.testing.assert_allclose(raw["data"][0]["embedding"], hidden(prompt)[-1], atol=1e-4)


def test_pooling_and_invocations_answer_the_same_vectors(http):
    body = {"input": TEXTS[0]}
    embedding = http.post("/v1/embeddings", json=body).json()
    pooled = http.post("/pooling", json=body | {"task": "embed"}).json()
    assert pooled["id"].startswith("pooling-") and embedding["id"].startswith("embd-")
    assert pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"][0]["data"], embedding["data"][0]["embedding"])
    invoked = http.post("/invocations", json=body).json()
    np.testing.assert_allclose(invoked["data"][0]["embedding"], embedding["data"][0]["embedding"])


def test_refusals_name_the_field(http):
    cases = [
        ({"input": []}, "input", "at least one prompt"),
        ({"input": [[]]}, "input", "may not be empty"),
        ({"input": "x", "dimensions": 8}, "dimensions", "does not support Matryoshka"),
        ({"input": "x", "normalize": True}, "normalize", "use `use_activation`"),
        ({"input": [[1] * (MAX_MODEL_LEN + 1)]}, "input_tokens", "must not exceed"),
        ({"input": [[999]]}, "input", "out of vocabulary"),
        ({"input": ["x"] * 1025}, "input", "--max-prompts-per-request"),
        ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, "input", "exactly one"),
        ({"input": "x", "encoding_format": "hex"}, "body.encoding_format", "'bytes_only'"),
        ({"input": "x", "task": "classify"}, "task", "this model's task is 'embed'"),
        ({"messages": [[]]}, "messages", "conversation may not be empty"),
        ({"input": 5}, "body.input", "a list of token ids"),
        ({"input": [[1, 2], "a"]}, "body.input", "a list of such lists"),
        ({"input": [{"content": "a"}]}, "body.messages.0.role", "Field required"),
    ]
    for body, param, text in cases:
        path = "/pooling" if "task" in body else "/v1/embeddings"
        assert_error(http.post(path, json=body), 400, param, [text])
    assert_error(http.post("/v1/embeddings", json={"input": "x", "model": "no"}), 404, "model")
    # A whole context is fine: nothing is generated after it.
    full = http.post("/v1/embeddings", json={"input": [[1] * MAX_MODEL_LEN]})
    assert full.status_code == 200 and full.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


def test_only_the_pooling_routes_are_served(http, default_server):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert http.post(path, json={}).status_code == 404, path
    assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
    doc = http.get("/openapi.json").json()
    config = FrontendConfig("", "", [], enable_dev_routes=True, pooling=PoolingOptions())
    assert set(doc["paths"]) == {r.path for r in served_routes(config)}
    assert {"/v1/embeddings", "/pooling", "/score", "/rerank", "/v2/rerank"} <= set(doc["paths"])
    # And a generating server has no embeddings.
    r = httpx.post(default_server.base_url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 404


def test_a_maximal_request_leaves_health_up_and_memory_bounded(server, http):
    """--max-prompts-per-request inputs each filling the context (1024 x 1024 token
    ids, a 4.6 MiB body; 2 MiB of vectors back), and a score of as many long texts:
    the probes answer throughout, the KV cache is empty after, memory comes back."""
    body = {"input": [[(i + j) % 300 for j in range(MAX_MODEL_LEN)] for i in range(1024)]}
    http.post("/v1/embeddings", json={"input": "warm"})
    time.sleep(2)
    baseline = rss(server)
    r = post_while_probing(http, "/v1/embeddings", body)
    assert r.status_code == 200 and len(r.json()["data"]) == 1024
    assert r.json()["usage"]["prompt_tokens"] == 1024 * MAX_MODEL_LEN
    # The most a score may tokenize: 1024 texts filling the body, each cut to 4 tokens.
    text = "word " * 1600
    body = {"queries": text, "documents": [text] * 1023, "max_tokens_per_doc": 4,
            "max_tokens_per_query": 4}  # fmt: skip
    r = post_while_probing(http, "/score", body)
    assert r.status_code == 200 and len(r.json()["data"]) == 1023
    stats = httpx.get(server.base_url + "/server_info").json()["engines"][0]["stats"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert_memory_returns(server, baseline)


def test_a_client_that_goes_away_frees_its_inputs_in_the_engine(server):
    body = json.dumps(
        {"input": [[(i + j) % 300 for j in range(MAX_MODEL_LEN)] for i in range(1024)]}
    ).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    def engine_stats() -> dict:
        return httpx.get(server.base_url + "/server_info").json()["engines"][0]["stats"]

    aborted = engine_stats()["num_aborted"]
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(head + body)
        # Gone once the engine holds the inputs (a slow box takes a while to parse them);
        # each runs for one step, so most of them wait.
        wait_for(lambda: engine_stats()["num_waiting"] > 0, timeout=60, what="the inputs to wait")

    def dropped() -> bool:  # (each API server has its own copy of the stats: ask again)
        stats = engine_stats()
        done = stats["num_running"] == stats["num_waiting"] == 0 < stats["num_aborted"] - aborted
        return done and stats["num_free_blocks"] == stats["num_total_blocks"]

    wait_for(dropped, timeout=20, interval=0.2, what="the engine to drop the aborted inputs")


def test_inputs_a_pause_aborts_are_a_503_not_a_vector(server, http):
    body = {"input": [[(i + j) % 300 for j in range(MAX_MODEL_LEN)] for i in range(1024)]}
    answers = []
    worker = threading.Thread(target=lambda: answers.append(http.post("/v1/embeddings", json=body)))
    worker.start()
    try:
        stats = lambda: httpx.get(server.base_url + "/server_info").json()["engines"][0]["stats"]  # noqa: E731
        wait_for(lambda: stats()["num_waiting"] > 0, timeout=60, what="the inputs to wait")
        assert http.post("/pause").status_code == 200  # mode abort, vLLM's default
        worker.join(60)
        assert_error(answers[0], 503, None, ["was paused (POST /pause?mode=abort)"])
    finally:
        http.post("/resume")
        worker.join(60)
    assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 200


@pytest.fixture(scope="module")
def sentence_transformers_model(tiny_model, tmp_path_factory):
    """The tiny llama as a sentence-transformers folder: MEAN pooling, no Normalize
    module, and Matryoshka dimensions."""
    folder = tmp_path_factory.mktemp("st-model") / "llama"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [8, 16]}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


def test_a_sentence_transformers_folder_sets_the_pooler(sentence_transformers_model, hidden):
    with ZServe(
        str(sentence_transformers_model), *SERVED_NAMES, *SMALL_KV, "--runner", "pooling"
    ) as s:
        prompt = list(range(3, 40))
        data = httpx.post(s.base_url + "/v1/embeddings", json={"input": [prompt]}).json()
        mean = hidden(prompt).mean(axis=0)  # MEAN, and no Normalize module: as it is
        np.testing.assert_allclose(data["data"][0]["embedding"], mean, atol=1e-4)
        body = {"input": [prompt], "dimensions": 8, "use_activation": True}
        cut = httpx.post(s.base_url + "/v1/embeddings", json=body).json()
        np.testing.assert_allclose(cut["data"][0]["embedding"], unit(mean[:8]), atol=1e-4)
        r = httpx.post(s.base_url + "/v1/embeddings", json={"input": "x", "dimensions": 9})
        assert_error(r, 400, "dimensions", ["Matryoshka dimensions [8, 16], got 9"])


def test_langchains_openai_embeddings(server, http, hidden):
    from langchain_openai import OpenAIEmbeddings

    # Its own token counting needs tiktoken's files (a download): off, as for any
    # model that is not OpenAI's.
    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=server.base_url + "/v1",
        api_key="none",
        check_embedding_ctx_length=False,
    )
    vectors = embeddings.embed_documents(TEXTS[:2])
    query = embeddings.embed_query(TEXTS[2])
    for vector, text in zip([*vectors, query], TEXTS):
        np.testing.assert_allclose(vector, unit(hidden(tokens(http, prompt=text))[-1]), atol=1e-4)


def test_a_lora_adapter_embeds_as_its_merged_model(http, tiny_model, adapter, hidden):
    from peft import PeftModel

    prompt = [5, 6, 7, 8, 9]
    merged = PeftModel.from_pretrained(reference_model(tiny_model("llama")), adapter)
    with torch.no_grad():
        states = merged.merge_and_unload().model(input_ids=torch.tensor([prompt]))
    r = http.post("/v1/embeddings", json={"input": [prompt], "model": "a"}).json()
    assert r["model"] == "a"
    expected = unit(states.last_hidden_state[0, -1].numpy())
    np.testing.assert_allclose(r["data"][0]["embedding"], expected, atol=1e-4)
    assert np.abs(expected - unit(hidden(prompt)[-1])).max() > 0.1  # not the base model's


# --- /score and /rerank: the cosine of two embeddings ------------------------------------


def test_scores_are_the_cosines_of_transformers_vectors(http, hidden):
    query, docs = "what is python", ["python is a language", "snakes", "def f(): pass"]
    vector = {t: unit(hidden(tokens(http, prompt=t))[-1]) for t in [query, *docs]}
    expected = [float(vector[query] @ vector[d]) for d in docs]
    num_tokens = sum(len(tokens(http, prompt=t)) for t in [query, *docs])
    for path, body in (
        ("/score", {"queries": query, "documents": docs}),
        ("/v1/score", {"text_1": query, "text_2": docs}),
        ("/score", {"data_1": [query], "data_2": docs}),
        ("/score", {"queries": query, "items": docs}),
    ):
        r = http.post(path, json=body).json()
        assert r["id"].startswith("score-") and r["object"] == "list"
        assert [d["index"] for d in r["data"]] == [0, 1, 2]
        np.testing.assert_allclose([d["score"] for d in r["data"]], expected, atol=1e-4)
        assert r["usage"]["prompt_tokens"] == num_tokens  # each text embedded once
    # N:N pairs the i-th with the i-th.
    pairs = http.post("/score", json={"queries": docs[:2], "documents": docs[1:]}).json()
    np.testing.assert_allclose(
        [d["score"] for d in pairs["data"]],
        [vector[docs[0]] @ vector[docs[1]], vector[docs[1]] @ vector[docs[2]]],
        atol=1e-4,
    )
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = http.post(path, json={"query": query, "documents": docs, "top_n": 2}).json()
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [x["index"] for x in r["results"]] == order
        assert [x["document"]["text"] for x in r["results"]] == [docs[i] for i in order]
        np.testing.assert_allclose(
            [x["relevance_score"] for x in r["results"]], [expected[i] for i in order], atol=1e-4
        )
        assert r["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    everything = http.post("/rerank", json={"query": query, "documents": docs}).json()
    assert len(everything["results"]) == 3


def test_scores_cut_texts_to_their_first_tokens(http, hidden):
    query, doc = "hello world and more", "hello there world and more"
    body = {"queries": query, "documents": doc, "max_tokens_per_query": 2, "max_tokens_per_doc": 3}
    r = http.post("/score", json=body).json()
    q = tokens(http, prompt=query, add_special_tokens=False)[:2]
    d = tokens(http, prompt=doc, add_special_tokens=False)[:3]
    bos = tokens(http, prompt="")  # the special tokens the tokenizer adds (BOS)
    expected = unit(hidden(bos + q)[-1]) @ unit(hidden(bos + d)[-1])
    assert abs(r["data"][0]["score"] - expected) < 1e-4
    assert r["usage"]["prompt_tokens"] == 2 * len(bos) + 5


def test_score_refusals_name_the_field(http):
    cases = [
        ("/score", {"data_1": ["a", "b"], "data_2": ["c", "d", "e"]}, "data_1", "1:1, 1:N or N:N"),
        ("/score", {"queries": "a", "documents": []}, "documents", "At least one"),
        ("/score", {"queries": [], "documents": "a"}, "queries", "At least one"),
        ("/score", {"queries": "a"}, "queries", "give one pair of sides"),
        ("/score", {"queries": "a", "documents": "b", "text_2": "c"}, "queries", "one pair"),
        ("/score", {"queries": {"content": []}, "documents": "b"}, "body.queries", "multimodal"),
        ("/score", {"queries": "a", "documents": "b", "max_tokens_per_doc": MAX_MODEL_LEN},
         "max_tokens_per_doc", "less than max_model_len"),
        ("/score", {"queries": "a", "documents": ["b"] * 1024}, "documents",
         "--max-prompts-per-request"),
        ("/rerank", {"documents": ["a"]}, "body.query", "Field required"),
        ("/rerank", {"query": "a", "documents": "b", "top_n": -1}, "body.top_n", "greater than"),
    ]  # fmt: skip
    for path, body, param, text in cases:
        assert_error(http.post(path, json=body), 400, param, [text])
