"""`zserve serve` with no MODEL: the built-in default model, driven by the official client."""

from __future__ import annotations

import openai
import pytest
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xdg-cache")
    with ZServe(env={"XDG_CACHE_HOME": str(cache)}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def test_default_model_is_built_into_the_user_cache_and_announced(server):
    log = server.log()
    assert "RANDOM weights" in log
    assert "zserve/models/small-llama" in log


def test_models_lists_the_default_name(client):
    assert [m.id for m in client.models.list().data] == ["zserve-default"]


def test_chat_completion_honours_max_tokens(client):
    r = client.chat.completions.create(
        model="zserve-default",
        messages=[{"role": "user", "content": "def fib(n):"}],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)


def test_streamed_chat_matches_the_non_streamed_one(client):
    kwargs = dict(
        model="zserve-default",
        messages=[{"role": "user", "content": "import os"}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == full
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completion_stream_and_not(client):
    r = client.completions.create(
        model="zserve-default",
        prompt="class Foo:",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    stream = client.completions.create(
        model="zserve-default",
        prompt="class Foo:",
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
