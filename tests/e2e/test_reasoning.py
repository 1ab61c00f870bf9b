"""Issue 17: reasoning split from the answer (`--reasoning-parser deepseek_r1`), on outputs a
regex constraint forces into the think-tag layout (the server constrains reasoning too:
`enable_in_reasoning`). Where a constraint starts after reasoning by default (vLLM's rule)
is tested on the engine (tests/integration/test_structured_output.py) and in
tests/unit/test_chat_tools.py."""

from __future__ import annotations

import json
import re

import pytest
from e2e_http import MODEL, SERVED_NAMES, SMALL_KV, http_client, post_stream, sync_client
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(240)

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Think, then answer."}]
THINK_THEN_ANSWER = r"[a-z ]{3,12}</think>[0-9]{1,3}"


@pytest.fixture(scope="module")
def server(tiny_model):
    flags = (
        "--reasoning-parser",
        "deepseek_r1",
        "--structured-outputs-config",
        '{"enable_in_reasoning": true, "disable_any_whitespace": true}',
        "--enable-scale-out",
    )
    with ZServe(str(tiny_model("llama")), *SERVED_NAMES, *SMALL_KV, *flags) as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def client(server):
    with sync_client(server) as c:
        yield c


def forced(**fields) -> dict:
    return {"structured_outputs": {"regex": THINK_THEN_ANSWER}, **fields}


def test_reasoning_and_answer_are_split_at_the_end_tag(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=40, n=2, seed=seed, extra_body=forced()
        )
        for choice in r.choices:
            message = choice.message
            assert choice.finish_reason == "stop"
            assert re.fullmatch(r"[a-z ]{3,12}", message.reasoning), message
            assert re.fullmatch(r"[0-9]{1,3}", message.content), message


def test_streamed_reasoning_and_content_deltas_rebuild_the_split(client, server):
    for seed in range(3):
        kwargs = dict(model=MODEL, messages=USER, max_tokens=40, seed=seed, extra_body=forced())
        full = client.chat.completions.create(**kwargs).choices[0].message
        with http_client(server) as http:
            _, sse = post_stream(
                http, CHAT, {"messages": USER, "max_tokens": 40, "seed": seed, **forced()}
            )
        deltas = [e["choices"][0]["delta"] for e in sse.events if e["choices"]]
        assert all(set(d) <= {"role", "content", "reasoning"} for d in deltas), deltas
        assert all(len(set(d) - {"role"}) <= 1 for d in deltas)  # one field per delta
        reasoning = "".join(d.get("reasoning", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        assert (reasoning, content) == (full.reasoning, full.content)
        assert "</think>" not in reasoning + content


def test_include_reasoning_false_drops_the_reasoning(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=40,
        seed=1,
        extra_body=forced(include_reasoning=False),
    )
    message = r.choices[0].message
    assert message.reasoning is None and re.fullmatch(r"[0-9]{1,3}", message.content)


def test_an_output_cut_inside_reasoning_is_all_reasoning(client):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, seed=1, extra_body=forced()
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert len(choice.message.reasoning) == 2


def test_the_responses_api_gives_a_reasoning_item_then_the_message(client, server):
    """/v1/responses reads the output through the same parser: a reasoning item (its
    text in a reasoning_text part), then the answer's message; streamed, the reasoning
    deltas and the text deltas rebuild both."""
    kwargs = dict(model=MODEL, input="Think, then answer.", max_output_tokens=40)
    r = client.responses.create(**kwargs, extra_body=forced(seed=1))
    assert [item.type for item in r.output] == ["reasoning", "message"]
    reasoning = r.output[0].content[0].text
    assert re.fullmatch(r"[a-z ]{3,12}", reasoning) and re.fullmatch(r"[0-9]{1,3}", r.output_text)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with http_client(server) as http:
        body = {**kwargs, **forced(seed=1), "stream": True}
        with http.stream("POST", "/v1/responses", json=body) as stream:
            text = stream.read().decode()
    payloads = [
        json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")
    ]
    thought = "".join(p["delta"] for p in payloads if p["type"] == "response.reasoning_text.delta")
    answer = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    assert (thought, answer) == (reasoning, r.output_text)
    final = payloads[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]


def test_a_rendered_request_says_where_its_constraint_starts_and_generate_keeps_it(server):
    """With enable_in_reasoning the constraint covers the reasoning too: the rendered
    request says the reasoning has ended (constrain from the first token), carries the
    reasoning parser's template arguments, and generate's text follows the regex."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 40, "seed": 1, **forced()}
    with http_client(server) as http:
        rendered = http.post("/v1/chat/completions/render", json=body).json()
        assert rendered["reasoning_ended"] is True
        assert rendered["reasoning_parser_kwargs"] == {"chat_template_kwargs": {}}
        out = http.post("/inference/v1/generate", json={**rendered, "output_mode": "text"})
        assert out.status_code == 200, out.text
        assert re.fullmatch(THINK_THEN_ANSWER, out.json()["choices"][0]["text"])


def test_derender_splits_reasoning_as_chat_does_and_needs_the_chat_request(server):
    body = {"model": MODEL, "messages": USER, "max_tokens": 40, "seed": 2, **forced()}
    with http_client(server) as http:
        direct = http.post(CHAT, json=body).json()["choices"][0]["message"]
        rendered = http.post("/v1/chat/completions/render", json=body).json()
        generated = http.post("/inference/v1/generate", json=rendered).json()
        derender = "/v1/chat/completions/derender"
        request = {"generate_response": generated, "prompt_token_ids": rendered["token_ids"]}
        r = http.post(derender, json={**request, "chat_request": body})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message == direct and message["reasoning"] and message["content"]
        r = http.post(derender, json=request)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_request"
