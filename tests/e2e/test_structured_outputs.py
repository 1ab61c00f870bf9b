"""Issue 17: structured outputs through HTTP and the official openai client, on the tiny
random-weight llama: the constraint alone decides whether the text is well formed, so every
document must parse and validate, for many seeds and schemas (hypothesis's too)."""

from __future__ import annotations

import asyncio
import json
import math
import re

import jsonschema
import pydantic
import pytest
from e2e_http import MODEL, assert_error, async_client, post_stream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(240)

C = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Describe someone."}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age"],
}
REGEX = r"[A-Z][a-z]{1,4}-\d{2,3}"
CHOICES = ["yes", "no", "it depends"]
ARITHMETIC = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'
TAG_FORMAT = {
    "type": "sequence",
    "elements": [
        {"type": "const_string", "value": "<n>"},
        {"type": "json_schema", "json_schema": {"type": "integer", "minimum": 0, "maximum": 9}},
        {"type": "const_string", "value": "</n>"},
    ],
}
STRUCTURAL_TAG = {"type": "structural_tag", "format": TAG_FORMAT}
# Nothing bounds a free JSON object: make closing quotes and brackets likely.
CLOSERS = {str(ord(c)): 6 for c in '"}]'}


def person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def choice(text: str) -> None:
    assert text in CHOICES, text


def arithmetic(text: str) -> None:
    assert re.fullmatch(r"[0-9()+]+", text) and text.count("(") == text.count(")"), text
    eval(text)  # balanced, well-formed arithmetic over digits  # noqa: S307


def digit_tag(text: str) -> None:
    assert re.fullmatch(r"<n>[0-9]</n>", text), text


# (request fields, the check of every choice's text): each way of stating a constraint.
CONSTRAINTS = {
    "structured_outputs.json": ({"structured_outputs": {"json": PERSON}}, person),
    "structured_outputs.json_object": (
        {"structured_outputs": {"json_object": True}, "logit_bias": CLOSERS},
        json_object,
    ),
    "structured_outputs.regex": ({"structured_outputs": {"regex": REGEX}}, regex),
    "structured_outputs.choice": ({"structured_outputs": {"choice": CHOICES}}, choice),
    "structured_outputs.grammar": ({"structured_outputs": {"grammar": ARITHMETIC}}, arithmetic),
    "structured_outputs.structural_tag": (
        {"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}},
        digit_tag,
    ),
    "guided_json": ({"guided_json": PERSON}, person),
    "guided_regex": ({"guided_regex": REGEX}, regex),
    "guided_choice": ({"guided_choice": CHOICES}, choice),
    "guided_grammar": ({"guided_grammar": ARITHMETIC}, arithmetic),
    "response_format.json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            }
        },
        person,
    ),
    "response_format.json_object": (
        {"response_format": {"type": "json_object"}, "logit_bias": CLOSERS},
        json_object,
    ),
    "response_format.structural_tag": (
        {"response_format": {"type": "structural_tag", "format": TAG_FORMAT}},
        digit_tag,
    ),
}


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_constraint_on_completions_yields_text_that_validates(tools_http, name):
    fields, check = CONSTRAINTS[name]
    for seed in (0, 1):
        body = {"prompt": f"Answer {seed}:", "max_tokens": 150, "n": 3, "seed": seed, **fields}
        r = tools_http.post(C, json=body)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "stop", c
            check(c["text"])


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_constraint_on_chat_yields_content_that_validates(tools_http, name):
    fields, check = CONSTRAINTS[name]
    body = {"messages": USER, "max_tokens": 150, "n": 2, "temperature": 0.8, "seed": 7, **fields}
    r = tools_http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop" and c["message"]["tool_calls"] == [], c
        check(c["message"]["content"])


def test_greedy_constrained_output_is_deterministic_and_streams_the_same_text(tools_http):
    body = {"prompt": "x", "max_tokens": 150, "temperature": 0, "guided_json": PERSON}
    texts = {tools_http.post(C, json=body).json()["choices"][0]["text"] for _ in range(2)}
    assert len(texts) == 1
    _, sse = post_stream(tools_http, C, body)
    assert "".join(e["choices"][0]["text"] for e in sse.events) == texts.pop()


def test_the_official_client_parses_a_pydantic_response_format(tools_client):
    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        legs: int = pydantic.Field(ge=0, le=8)
        kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog"]})

    for seed in range(3):
        r = tools_client.chat.completions.parse(
            model=MODEL,
            messages=USER,
            response_format=Pet,
            max_completion_tokens=120,
            seed=seed,
        )
        message = r.choices[0].message
        assert isinstance(message.parsed, Pet), message
        assert message.parsed == Pet.model_validate_json(message.content)


def test_logprobs_are_those_of_the_masked_distribution(tools_client):
    r = tools_client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_completion_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content in ("yes", "no")
    first = {t.token: t.logprob for t in content[0].top_logprobs if t.logprob > -9999.0}
    assert set(first) == {"y", "n"}  # the only tokens the constraint allows first
    assert sum(math.exp(v) for v in first.values()) == pytest.approx(1, abs=1e-4)
    assert all(t.logprob == pytest.approx(0.0, abs=1e-5) for t in content[1:])


def test_stop_strings_cut_constrained_text(tools_http):
    body = {"prompt": "x", "max_tokens": 20, "seed": 3, "guided_regex": "[a-c]{15}", "stop": ["c"]}
    for seed in range(4):
        c = tools_http.post(C, json={**body, "seed": seed}).json()["choices"][0]
        assert c["finish_reason"] == "stop" and re.fullmatch("[ab]*", c["text"]), c


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(tools_server):
    free = {
        "prompt": "Hello",
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }

    async def run() -> tuple[str, list[str]]:
        async with async_client(tools_server, timeout=120) as client:
            alone = (await client.completions.create(model=MODEL, **free)).choices[0].text
            constrained = [
                client.completions.create(
                    model=MODEL,
                    prompt=f"Q{i}",
                    max_tokens=150,
                    seed=i,
                    extra_body={"guided_json": PERSON},
                )
                for i in range(6)
            ]
            results = await asyncio.gather(
                client.completions.create(model=MODEL, **free), *constrained
            )
            return alone, [results[0].choices[0].text] + [r.choices[0].text for r in results[1:]]

    alone, (mixed, *documents) = asyncio.run(run())
    assert mixed == alone
    for text in documents:
        person(text)


# Bounded schemas: every string, array and number has a length or range limit, so a
# random model cannot run out of tokens inside one.
_names = st.sampled_from(["a", "b", "id", "name", "x_1", "ключ"])
_words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=3)
_leaves = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-999, 999), st.integers(0, 2000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(_words | st.integers(-9, 9), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.sampled_from([{"type": "string", "pattern": "^[a-c]{1,3}$"}]),
)
_schemas = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.tuples(children, st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}
        ),
        st.dictionaries(_names, children, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1]}
        ),
    ),
    max_leaves=4,
)


@settings(
    max_examples=8,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=_schemas, seed=st.integers(0, 1000))
def test_generated_json_schemas_yield_documents_that_validate(tools_http, schema, seed):
    body = {
        "prompt": "x",
        "max_tokens": 300,
        "n": 2,
        "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    r = tools_http.post(C, json=body)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), schema)


BAD = [
    ({"guided_json": {"type": "bogus"}}, "guided_json", ["bogus"]),
    ({"structured_outputs": {"regex": "[.*"}}, "structured_outputs.regex", ["Regex"]),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", []),
    ({"structured_outputs": {"json": {"type": "object", "not": {}}}}, "structured_outputs.json", ["'not'"]),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs.json", ["uniqueItems"]),
    ({"structured_outputs": {"grammar": "root ::= " + '"ab" | ' * 12000 + '"c"'}}, "structured_outputs.grammar", ["65536"]),
    ({"structured_outputs": {"choice": [str(i) for i in range(1025)]}}, "structured_outputs.choice", ["1024"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["non-empty"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", ["unknown key"]),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend", ["xgrammar"]),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", []),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", ["true"]),
    ({"structured_outputs": 5}, "structured_outputs", ["object"]),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", ["one output constraint"]),
    ({"guided_decoding_backend": "lm-format-enforcer", "guided_regex": "a"}, "guided_decoding_backend", []),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", ["response_format"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", []),
    ({"response_format": {"type": "structural_tag"}}, "response_format", ["format"]),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD, ids=[b[1] for b in BAD])
def test_a_bad_constraint_is_a_400_naming_the_field(tools_http, fields, param, words):
    assert_error(tools_http.post(C, json={"prompt": "x", **fields}), 400, param, words)


def test_a_constraint_that_fails_to_compile_in_a_stream_is_an_error_event(tools_http):
    r, sse = post_stream(tools_http, CHAT, {"messages": USER, "guided_regex": "(("})
    assert r.status_code == 200 and sse.done
    (error,) = [e["error"] for e in sse.events if "error" in e]
    assert error["code"] == 400 and error["message"].startswith("guided_regex:"), error
    assert error["param"] == "guided_regex"
    r = tools_http.post(CHAT, json={"messages": USER, "max_tokens": 40, "guided_regex": "a{3}"})
    assert r.json()["choices"][0]["message"]["content"] == "aaa"  # the server serves on
