"""Issue 4, item 5 as a property: whatever JSON (or non-JSON) a client posts to any POST
route, the answer is never a 5xx, every 4xx carries the error body, every stream ends
with [DONE] and no error event, and the server keeps answering."""

from __future__ import annotations

import json

import httpx
import pytest
from e2e_http import MODEL, SERVED_NAMES, SMALL_KV, assert_error_body, parse_named_sse, parse_sse
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tiny_classifier import build_classifier
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(240)

ROUTES = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/tokenize",
    "/detokenize",
    "/invocations",
    "/ping",
]
SETTINGS = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# --- values -----------------------------------------------------------------------------

EDGE = st.sampled_from(
    [
        -1,
        0,
        1,
        2**31,
        2**63 - 1,
        2**63,
        -(2**63) - 1,
        2**64,
        10**30,
        -(10**30),
        1e308,
        -1e308,
        1e-320,
        0.5,
        -0.0,
        "",
        " ",
        "\u0000",
        "🙂" * 3,
        "\ud7ff\ue000",
        "x" * 5000,
        "é" * 200_000,
        "<|im_start|>",
        "é\n\r\t",
        [],
        {},
        [[]],
        [None],
        True,
        False,
    ]
)
LEAF = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-5, max_value=400)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
    | EDGE
)
JSON = st.recursive(
    LEAF,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
TOKEN_IDS = st.lists(st.integers(min_value=-3, max_value=330), max_size=12)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "tool", ""]) | LEAF,
        "content": st.text(max_size=40)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url", "input_audio", "x"]) | LEAF},
                optional={"text": st.text(max_size=20) | LEAF, "image_url": JSON},
            ),
            max_size=3,
        )
        | JSON,
        "name": LEAF,
        "tool_calls": JSON,
    },
)
# A /v1/responses input item that is not a message.
ITEM = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["function_call", "function_call_output", "reasoning", "item_reference", "x"]
        )
        | LEAF
    },
    optional={"call_id": LEAF, "name": LEAF, "arguments": LEAF, "output": LEAF | JSON},
)
# Generation size is bounded (valid values only small) so the property runs in seconds.
SMALL = st.integers(min_value=-3, max_value=8)
SIZE_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "n"}


# Plausible values of every field (often valid, sometimes not); junk() adds anything.
FIELDS: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from([MODEL, "tiny-alias", "", "gpt-4"]),
    "prompt": st.text(max_size=40)
    | TOKEN_IDS
    | st.lists(st.text(max_size=10), max_size=4)
    | st.lists(TOKEN_IDS, max_size=3),
    "messages": st.lists(MESSAGE, max_size=4),
    "tokens": TOKEN_IDS,
    "max_tokens": SMALL,
    "max_completion_tokens": SMALL,
    "min_tokens": SMALL,
    "n": st.integers(min_value=-1, max_value=3),
    "temperature": st.floats(min_value=-1, max_value=3),
    "top_p": st.floats(min_value=-0.5, max_value=1.5),
    "top_k": st.integers(min_value=-3, max_value=400),
    "min_p": st.floats(min_value=-0.5, max_value=1.5),
    "presence_penalty": st.floats(min_value=-3, max_value=3),
    "frequency_penalty": st.floats(min_value=-3, max_value=3),
    "repetition_penalty": st.floats(min_value=-1, max_value=3),
    "seed": st.integers(),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "stop_token_ids": TOKEN_IDS,
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(
        st.integers(min_value=-3, max_value=330).map(str) | st.text(max_size=4),
        st.floats(allow_nan=False, allow_infinity=False) | LEAF,
        max_size=3,
    ),
    "allowed_token_ids": TOKEN_IDS,
    "logprobs": st.integers(min_value=-2, max_value=22) | st.booleans(),
    "top_logprobs": st.integers(min_value=-2, max_value=22),
    "prompt_logprobs": st.integers(min_value=-2, max_value=22),
    "echo": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": LEAF, "continuous_usage_stats": LEAF}
    ),
    "suffix": st.text(max_size=4),
    "best_of": SMALL,
    "skip_special_tokens": st.booleans(),
    "priority": st.integers(min_value=-2, max_value=2),
    "request_id": st.text(max_size=20),
    "return_token_ids": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "truncate_prompt_tokens": st.integers(min_value=-2, max_value=1100),
    "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template": st.sampled_from(["{{ messages }}", "{% for %}", "{{ 1/0 }}"]),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "tools", "documents", "x", "tokenize"]), JSON
    ),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "bogus"]) | LEAF},
        optional={"json_schema": JSON},
    ),
    "tools": JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "return_token_strs": st.booleans(),
    "use_beam_search": st.booleans(),
    "structured_outputs": JSON,
    # /v1/responses
    "input": st.text(max_size=40) | st.lists(MESSAGE | ITEM, max_size=4),
    "instructions": st.text(max_size=20) | LEAF,
    "max_output_tokens": SMALL,
    "text": st.fixed_dictionaries(
        {},
        optional={
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema", "x"]) | LEAF},
                optional={"schema": JSON, "name": LEAF},
            )
        },
    ),
    "reasoning": JSON,
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "x"]) | LEAF),
    "previous_response_id": st.text(max_size=8) | LEAF,
    # /v1/messages
    "system": st.text(max_size=20) | st.lists(JSON, max_size=2) | LEAF,
    "stop_sequences": st.lists(st.text(max_size=5), max_size=3) | LEAF,
    "thinking": JSON,
    "truncation": st.sampled_from(["auto", "disabled", "middle"]) | LEAF,
    # /inference/v1/generate and /inference/v1/abort_requests
    "token_ids": TOKEN_IDS,
    "output_mode": st.sampled_from(["tokens", "text", "x"]) | LEAF,
    "reasoning_ended": LEAF,
    "request_ids": st.lists(st.text(max_size=12), max_size=4) | JSON,
}
# A generate response to derender (tokens mode), often well formed.
GENERATED_CHOICE = st.fixed_dictionaries(
    {"index": SMALL, "token_ids": TOKEN_IDS},
    optional={
        "finish_reason": st.sampled_from(["stop", "length", "abort"]) | LEAF,
        "stop_reason": LEAF,
        "logprobs": JSON,
    },
)
GENERATED = st.fixed_dictionaries(
    {"request_id": st.text(max_size=8), "choices": st.lists(GENERATED_CHOICE, max_size=3)},
    optional={"prompt_token_ids": TOKEN_IDS, "output_mode": LEAF, "usage": JSON},
)
FIELDS |= {
    "generate_response": GENERATED | JSON,
    "generate_responses": st.lists(GENERATED, max_size=3) | JSON,
    "prompt_token_ids": TOKEN_IDS | LEAF,
    "prompt_tokens": SMALL | JSON,
    "chat_request": st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=2)}) | JSON,
    "completion_request": st.fixed_dictionaries({"prompt": FIELDS["prompt"]}) | JSON,
}
# vLLM's SamplingParams fields, as generate's sampling_params carries them.
SAMPLING_KEYS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "skip_special_tokens", "logit_bias", "allowed_token_ids", "structured_outputs",
)  # fmt: skip
FIELDS["sampling_params"] = (
    st.fixed_dictionaries(
        {},
        optional={
            **{k: FIELDS[k] for k in SAMPLING_KEYS},
            "detokenize": st.booleans() | LEAF,
            "bad_words": st.lists(st.text(max_size=4), max_size=2),
            "output_kind": LEAF,
        },
    )
    | JSON
)
# What each route needs to get past the first check, most of the time.
BASES = {
    "/v1/completions": {"prompt": "hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104, 105]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions/render": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions/render": {"prompt": "hi"},
    "/inference/v1/generate": {"token_ids": [1, 72], "sampling_params": {"max_tokens": 4}},
    "/inference/v1/abort_requests": {"request_ids": ["nobody"]},
    "/v1/chat/completions/derender": {
        "generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": [72]}]}
    },
    "/v1/completions/derender": {
        "generate_responses": [{"request_id": "g", "choices": [{"index": 0, "token_ids": [72]}]}]
    },
    "/invocations": {"prompt": "hi"},
    "/ping": {},
}


def junk(name: str) -> st.SearchStrategy:
    if name in SIZE_FIELDS:  # never a large valid size (nor null: chat's default is huge)
        return FIELDS[name] | EDGE.filter(lambda v: v is not None)
    return FIELDS[name] | EDGE | JSON


@st.composite
def field_bodies(draw) -> tuple[str, dict]:
    """A route's minimal body (most of the time) plus a few fields: in half the cases
    with plausible values only, otherwise with anything."""
    route = draw(st.sampled_from(ROUTES))
    body = dict(BASES[route]) if draw(st.integers(0, 3)) else {}
    wild = draw(st.booleans())
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=6, unique=True))
    for name in names:
        body[name] = draw(junk(name) if wild else FIELDS[name])
    if "messages" in body and not {"max_tokens", "max_completion_tokens"} & body.keys():
        body["max_tokens"] = 4  # chat's default is the whole context: too slow here
    if route == "/v1/responses" and "max_output_tokens" not in body:
        body["max_output_tokens"] = 4
    if route == "/v1/messages" and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8)  # the default is required here
    params = body.get("sampling_params")
    if isinstance(params, dict):  # unset (or null), max_tokens is the rest of the context
        limit = params.get("max_tokens")
        if limit is None or (isinstance(limit, int) and limit > 8):
            params["max_tokens"] = 4
    return route, body


# --- the property ------------------------------------------------------------------------


def check_error(route: str, r: httpx.Response) -> None:
    """A 4xx with the error body of its API: Anthropic's shape on /v1/messages."""
    assert r.headers["content-type"].startswith("application/json"), r.headers
    if route.startswith("/v1/messages"):
        error = r.json()
        assert set(error) == {"type", "error"} and error["type"] == "error", error
        assert error["error"]["type"] and error["error"]["message"], error
    else:
        assert_error_body(r.json(), r.status_code)


def check(http: httpx.Client, route: str, content: bytes, content_type: str) -> None:
    r = http.post(route, content=content, headers={"content-type": content_type})
    assert r.status_code < 500, (route, content[:300], r.status_code, r.text[:500])
    if route == "/ping":
        assert r.status_code == 200
        return
    if r.status_code >= 400:
        check_error(route, r)
        return
    assert r.status_code == 200, (route, content[:300], r.status_code, r.text[:300])
    last_event = {"/v1/responses": "response.completed", "/v1/messages": "message_stop"}
    if r.headers["content-type"].startswith("text/event-stream") and route in last_event:
        events = parse_named_sse(r.text)  # named events, no [DONE]
        assert events[-1]["type"] == last_event[route], (content[:300], r.text[-500:])
    elif r.headers["content-type"].startswith("text/event-stream"):
        sse = parse_sse(r.text)
        assert sse.done, r.text[-300:]
        assert not any("error" in e for e in sse.events), (content[:300], r.text[-500:])
    else:  # a completion's render: one generate request per prompt
        assert isinstance(r.json(), list if route == "/v1/completions/render" else dict)


@pytest.fixture(scope="module")
def fuzz_http(default_server):
    with httpx.Client(base_url=default_server.base_url, timeout=60) as c:
        yield c
    # Afterwards the server still serves ordinary requests.
    assert httpx.get(default_server.base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(
        default_server.base_url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 3},
        timeout=30,
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


@settings(max_examples=300, **SETTINGS)
@given(route=st.sampled_from(ROUTES), body=JSON)
def test_any_json_value_gets_an_answer_that_is_not_a_5xx(fuzz_http, route, body):
    check(fuzz_http, route, json.dumps(body).encode(), "application/json")


@settings(max_examples=1500, **SETTINGS)
@given(case=field_bodies())
@example(case=("/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True}))
@example(case=("/v1/messages", {**BASES["/v1/messages"], "stream": True}))
@example(
    case=(
        "/inference/v1/generate",
        {"token_ids": [1, 72], "sampling_params": {"max_tokens": 4, "n": 2}, "stream": True},
    )
)
def test_known_fields_with_any_values_get_an_answer_that_is_not_a_5xx(fuzz_http, case):
    route, body = case
    check(fuzz_http, route, json.dumps(body).encode(), "application/json")


@settings(max_examples=300, **SETTINGS)
@given(
    route=st.sampled_from(ROUTES),
    content=st.binary(max_size=300) | st.text(max_size=100).map(str.encode),
    content_type=st.sampled_from(
        ["application/json", "application/json; charset=utf-8", "text/plain", ""]
    ),
)
def test_malformed_bodies_get_an_answer_that_is_not_a_5xx(fuzz_http, route, content, content_type):
    check(fuzz_http, route, content, content_type)


# --- a pooling server (--runner pooling): /v1/embeddings and /pooling -------------------

POOLING_ROUTES = ["/v1/embeddings", "/pooling", "/invocations", "/score", "/rerank", "/v2/embed"]
TEXTS = st.text(max_size=30) | st.lists(st.text(max_size=20), max_size=4)
POOLING_FIELDS: dict[str, st.SearchStrategy] = {
    "model": FIELDS["model"],
    "input": FIELDS["prompt"] | st.lists(MESSAGE, max_size=3) | st.lists(st.lists(MESSAGE)),
    "messages": FIELDS["messages"] | st.lists(st.lists(MESSAGE, max_size=2), max_size=2),
    "encoding_format": st.sampled_from(["float", "base64", "bytes", "bytes_only", "x"]),
    "embed_dtype": st.sampled_from(["float32", "float16", "bfloat16", "fp8_e4m3"]),
    "endianness": st.sampled_from(["native", "big", "little", "middle"]),
    "dimensions": st.integers(min_value=-2, max_value=70),
    "use_activation": st.booleans(),
    "normalize": st.booleans(),
    "task": st.sampled_from(["embed", "classify", "token_embed"]),
    "truncation_side": st.sampled_from(["left", "right", "up"]),
    **{
        name: FIELDS[name]
        for name in (
            "truncate_prompt_tokens", "add_special_tokens", "add_generation_prompt",
            "continue_final_message", "chat_template", "chat_template_kwargs", "priority",
            "request_id",
        )
    },
    "cache_salt": st.text(max_size=8) | LEAF,
    # /score and /rerank
    **dict.fromkeys(["queries", "documents", "items", "data_1", "data_2", "text_1", "text_2"], TEXTS),
    "query": st.text(max_size=30),
    "top_n": st.integers(min_value=-1, max_value=5),
    "max_tokens_per_query": st.integers(min_value=-1, max_value=1100),
    "max_tokens_per_doc": st.integers(min_value=-1, max_value=1100),
    "instruction": st.text(max_size=10),
    # /v2/embed (Cohere's)
    "texts": st.lists(st.text(max_size=20), max_size=4),
    "images": st.lists(st.text(max_size=10), max_size=2),
    "inputs": st.lists(st.fixed_dictionaries({"content": st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=3)}),
        max_size=3),
    "input_type": st.sampled_from(["search_query", "search_document", "image", ""]),
    "truncate": st.sampled_from(["NONE", "START", "END", "MIDDLE"]),
    "max_tokens": st.integers(min_value=-1, max_value=1100),
    "embedding_types": st.lists(st.sampled_from(["float", "binary", "ubinary", "base64", "int8"]),
                                max_size=5),
    "output_dimension": st.integers(min_value=-2, max_value=70),
}  # fmt: skip


@st.composite
def pooling_bodies(draw, routes: list[str] = POOLING_ROUTES) -> tuple[str, dict]:
    route = draw(st.sampled_from(routes))
    body = dict(POOLING_BASES[route]) if draw(st.integers(0, 3)) else {}
    wild = draw(st.booleans())
    names = draw(st.lists(st.sampled_from(sorted(POOLING_FIELDS)), max_size=5, unique=True))
    if draw(st.booleans()):  # the output's form, as one group: each combination is its path
        names = [n for n in names if n not in _FORMAT] + list(_FORMAT)
    for name in names:
        body[name] = draw(POOLING_FIELDS[name] | EDGE | JSON if wild else POOLING_FIELDS[name])
    return route, body


_FORMAT = ("encoding_format", "embed_dtype", "endianness")
POOLING_BASES = {
    "/v1/embeddings": {"input": "hi"},
    "/pooling": {"input": "hi"},
    "/invocations": {"input": "hi"},
    "/classify": {"input": "hi"},
    "/score": {"queries": "hi", "documents": ["a", "b"]},
    "/rerank": {"query": "hi", "documents": ["a", "b"]},
    "/v2/embed": {"texts": ["hi"]},
}


@pytest.fixture(scope="module")
def pooling_http(tiny_model):
    with ZServe(str(tiny_model("llama")), *SERVED_NAMES, *SMALL_KV, "--runner", "pooling") as s:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            yield c
        assert httpx.get(s.base_url + "/health", timeout=10).status_code == 200
        r = httpx.post(s.base_url + "/v1/embeddings", json={"input": "hello"}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"]) == 1
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@settings(max_examples=600, **SETTINGS)
@given(case=pooling_bodies())
@example(case=("/v1/embeddings", {"input": [[1, 2]], "encoding_format": "bytes"}))
def test_a_pooling_servers_routes_never_answer_a_5xx(pooling_http, case):
    check_pooling_answer(pooling_http, case)


@pytest.fixture(scope="module")
def cross_encoder_http(tiny_model, tmp_path_factory):
    """A one-label sequence classifier whose tokenizer joins pairs with a separator."""
    out = tmp_path_factory.mktemp("ce") / "ce"
    model = build_classifier(tiny_model("llama"), out, ["relevant"], separator="<|endoftext|>")
    with ZServe(str(model), *SERVED_NAMES, *SMALL_KV) as s:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            yield c
        r = httpx.post(s.base_url + "/classify", json={"input": "hello"}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"]) == 1
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


CLASSIFY_ROUTES = ["/classify", "/pooling", "/invocations", "/score", "/rerank"]


@settings(max_examples=300, **SETTINGS)
@given(case=pooling_bodies(CLASSIFY_ROUTES))
def test_a_cross_encoders_routes_never_answer_a_5xx(cross_encoder_http, case):
    check_pooling_answer(cross_encoder_http, case)


def check_pooling_answer(http: httpx.Client, case: tuple[str, dict]) -> None:
    route, body = case
    r = http.post(route, json=body)
    assert r.status_code < 500, (route, body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        check_error(route, r)
    elif r.headers["content-type"] == "application/octet-stream":
        assert len(r.content) % 2 == 0 and r.content
    elif route == "/rerank":
        assert r.json()["results"]
    elif route == "/v2/embed":
        assert r.json()["response_type"] == "embeddings_by_type" and r.json()["embeddings"]
    else:
        assert r.json()["object"] == "list" and r.json()["data"]


# --- every route, and the headers ---------------------------------------------------------

GET_ROUTES = [
    "/v1/models",
    "/health",
    "/live",
    "/ping",
    "/load",
    "/version",
    "/metrics",
    "/server_info",
    "/tokenizer_info",
    "/openapi.json",
]
# Values any HTTP client can send (no surrounding blanks: h11 refuses to send those).
HEADER_VALUE = (
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)
    | st.sampled_from(["-1", "0", "1", "2", "99999999999999999999", "1e3", "nan", ""])
    | st.integers(min_value=-(2**70), max_value=2**70).map(str)
)
HEADERS = st.dictionaries(
    st.sampled_from(
        [
            "x-request-id",
            "x-priority",
            "x-vllm-priority",
            "x-data-parallel-rank",
            "authorization",
            "accept",
            "accept-encoding",
            "origin",
            "x-forwarded-for",
            "endpoint-load-metrics-format",
        ]
    )
    | st.from_regex(r"\Ax-[a-z0-9-]{1,20}\Z"),
    HEADER_VALUE,
    max_size=5,
)
QUERY = st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=3)


@settings(max_examples=300, **SETTINGS)
@given(route=st.sampled_from(GET_ROUTES), headers=HEADERS, query=QUERY, body=JSON)
def test_get_routes_with_any_headers_query_or_body_are_never_a_5xx(
    fuzz_http, route, headers, query, body
):
    r = fuzz_http.request(
        "GET", route, headers=headers, params=query, content=json.dumps(body).encode()
    )
    assert r.status_code < 500, (route, headers, query, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert_error_body(r.json(), r.status_code)


@settings(max_examples=400, **SETTINGS)
@given(case=field_bodies(), headers=HEADERS)
def test_post_routes_with_any_headers_are_never_a_5xx(fuzz_http, case, headers):
    route, body = case
    headers = {**headers, "content-type": "application/json"}
    r = fuzz_http.post(route, content=json.dumps(body).encode(), headers=headers)
    assert r.status_code < 500, (route, headers, body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        check_error(route, r)
