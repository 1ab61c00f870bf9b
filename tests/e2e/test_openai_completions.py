"""Issue 4, item 2: /v1/completions through the official client (sync, async, streaming)
and raw HTTP, on the tiny llama (token id = byte value, so prompt lengths are exact)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from e2e_http import MODEL, assert_error, async_client, post_stream

pytestmark = pytest.mark.timeout(120)

PROMPT = "Hello, my name is"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LOWERCASE = list(range(ord("a"), ord("z") + 1))


def test_a_string_prompt_gives_exact_usage_and_finish_length(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, **GREEDY)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason == "length"
    p = len(PROMPT.encode())
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (p, 5, p + 5)
    assert r.system_fingerprint.startswith("zserve-")  # --fingerprint-mode full


def test_max_tokens_defaults_to_16(client):
    r = client.completions.create(model=MODEL, prompt="x", **GREEDY)
    assert r.usage.completion_tokens == 16


def test_model_may_be_omitted_empty_or_an_alias(http):
    for model in (None, "", "tiny-alias"):
        body = {"prompt": "x", "max_tokens": 1}
        if model is not None:
            body["model"] = model
        assert http.post("/v1/completions", json=body).json()["model"] == MODEL


def test_token_id_prompts_and_no_prompt_logprobs_by_default(client):
    r = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=3, **GREEDY)
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].model_extra["prompt_logprobs"] is None


def test_every_prompt_form_gives_one_choice_per_prompt_and_sample(client):
    ids = list(b"abc")
    single = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, **GREEDY)
    text = single.choices[0].text
    for prompt in ("abc", ["abc", "abc"], ids, [ids, ids]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=2, **GREEDY)
        prompts = 2 if isinstance(prompt[0], (str, list)) and not isinstance(prompt, str) else 1
        assert [c.index for c in r.choices] == list(range(2 * prompts))
        assert all(c.text == text for c in r.choices)
        assert r.usage.prompt_tokens == 3 * prompts
        assert r.usage.completion_tokens == 4 * 2 * prompts


def test_a_batch_streams_one_choice_per_chunk(client):
    stream = client.completions.create(
        model=MODEL, prompt=["ab", "ab"], max_tokens=5, stream=True, **GREEDY
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0] == texts[1] != ""


def test_stream_equals_the_full_response_and_ends_with_one_finish(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True, **GREEDY)
    )
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_async_client_completes_and_streams_concurrently(default_server):
    async def run():
        async with async_client(default_server) as c:
            kwargs = dict(model=MODEL, prompt="abc", max_tokens=6, **GREEDY)
            full, streamed = await asyncio.gather(
                c.completions.create(**kwargs),
                _collect(await c.completions.create(**kwargs, stream=True)),
            )
            return full.choices[0].text, streamed

    async def _collect(stream):
        return "".join([chunk.choices[0].text async for chunk in stream])

    full, streamed = asyncio.run(run())
    assert full == streamed


# --- echo -------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY)
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, **GREEDY
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


@pytest.mark.parametrize("k", [0, 1])
def test_echo_with_logprobs_covers_the_prompt_tokens(client, k):
    """§5 item 25."""
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, logprobs=k, **GREEDY
    )
    lp = r.choices[0].logprobs
    p = len(PROMPT.encode())
    assert r.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == p + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(max(k, 1) <= len(top) <= k + 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[p] == len(PROMPT)


def test_echo_with_max_tokens_zero_returns_just_the_prompt(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, **GREEDY
    )
    choice = r.choices[0]
    p = len(PROMPT.encode())
    assert choice.text == PROMPT
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == p
    assert choice.logprobs.tokens == list(PROMPT)
    assert choice.logprobs.token_logprobs[0] is None
    assert all(x <= 0 for x in choice.logprobs.token_logprobs[1:])
    # The same through a stream: one chunk with the prompt, then the usage chunk.
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=0,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert chunks[-1].usage.completion_tokens == 0


def test_max_tokens_zero_without_echo_is_refused(http):
    assert_error(
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens"
    )


# --- logprobs ---------------------------------------------------------------------------


# The legacy top_logprobs dicts are keyed by token text, and many bytes of the tiny
# byte-level vocabulary decode to the same "\ufffd": count them by id instead.
AS_IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}


def test_logprobs_none_zero_and_five(client):
    """§5 item 12, and the legacy shape with a running text_offset."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert client.completions.create(**kwargs).choices[0].logprobs is None
    lp0 = client.completions.create(**kwargs, logprobs=0, extra_body=AS_IDS).choices[0].logprobs
    assert all(len(top) == 1 for top in lp0.top_logprobs)
    r5 = client.completions.create(**kwargs, logprobs=5, extra_body=AS_IDS)
    lp5 = r5.choices[0].logprobs
    assert len(lp5.tokens) == len(lp5.token_logprobs) == len(lp5.text_offset) == 6
    assert all(t.startswith("token_id:") for t in lp5.tokens)
    assert all(5 <= len(top) <= 6 for top in lp5.top_logprobs)
    for i in range(5):
        assert lp5.text_offset[i + 1] - lp5.text_offset[i] == len(lp5.tokens[i])
    # Greedy: the chosen token is the most likely one.
    for token, logprob, top in zip(lp5.tokens, lp5.token_logprobs, lp5.top_logprobs):
        assert top[token] == logprob == max(top.values())
    lower = {"ignore_eos": True, "allowed_token_ids": LOWERCASE}
    text = client.completions.create(**kwargs, logprobs=1, extra_body=lower).choices[0]
    assert "".join(text.logprobs.tokens) == text.text


def test_too_many_logprobs_is_a_400_and_the_server_keeps_serving(client, http):
    """§5 item 13 (the limit is --max-logprobs, default 20)."""
    ok = client.completions.create(
        model=MODEL, prompt="x", max_tokens=1, logprobs=20, extra_body=AS_IDS
    )
    assert len(ok.choices[0].logprobs.top_logprobs[0]) >= 20
    for stream in (False, True):
        r = http.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1, "logprobs": 21, "stream": stream},
        )
        assert_error(r, 400, "logprobs", contains=["21", "20"])
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_streamed_logprobs_equal_the_full_ones_even_when_text_is_held_back(client):
    """Tokens whose text a stop string holds back keep their logprob entries."""
    base = dict(model=MODEL, prompt="abc", max_tokens=24, logprobs=2, temperature=0)
    bias = {"ignore_eos": True, "allowed_token_ids": LOWERCASE}
    text = client.completions.create(**base, extra_body=bias).choices[0].text
    stop = text[14:18]  # four characters: three of them are held back at a time
    full = client.completions.create(**base, stop=[stop], extra_body=bias).choices[0]
    chunks = list(client.completions.create(**base, stop=[stop], stream=True, extra_body=bias))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    logprobs = [
        x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs
    ]
    assert tokens == full.logprobs.tokens
    assert logprobs == pytest.approx(full.logprobs.token_logprobs)
    offsets = [
        x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset
    ]
    assert offsets == full.logprobs.text_offset


# --- n and seeds ------------------------------------------------------------------------


def test_n_with_a_seed_gives_distinct_reproducible_samples(client):
    """§5 item 16."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=42)
    first = client.completions.create(**kwargs, logprobs=0)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == texts


def test_n_streams_every_index_to_its_own_finish(client):
    """§5 item 17: exactly n finish reasons; no index gets more chunks than tokens."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    texts, counts, finishes = {}, {}, []
    for chunk in chunks:
        (c,) = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        counts[c.index] = counts.get(c.index, 0) + 1
        if c.finish_reason:
            finishes.append(c.index)
    assert sorted(finishes) == [0, 1, 2]
    assert all(n <= 8 for n in counts.values())
    assert [texts[i] for i in range(3)] == [c.text for c in full.choices]


# --- stop strings -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def lowercase_text(client) -> str:
    """A greedy continuation made of a-z only, so stop strings can be cut from it."""
    r = client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True, "allowed_token_ids": LOWERCASE},
    )
    return r.choices[0].text


def _stopped(client, stop, stream: bool, include: bool = False):
    kwargs = dict(
        model=MODEL,
        prompt="abc",
        max_tokens=30,
        temperature=0,
        stop=stop,
        extra_body={
            "ignore_eos": True,
            "allowed_token_ids": LOWERCASE,
            "include_stop_str_in_output": include,
        },
    )
    if not stream:
        c = client.completions.create(**kwargs).choices[0]
        return c.text, c.finish_reason, c.model_extra["stop_reason"]
    text, finish, reason = "", None, None
    for chunk in client.completions.create(**kwargs, stream=True):
        (c,) = chunk.choices
        text += c.text
        if c.finish_reason:
            finish, reason = c.finish_reason, c.model_extra["stop_reason"]
    return text, finish, reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_before_it(client, lowercase_text, stream):
    stop = lowercase_text[15:19]
    cut = lowercase_text.find(stop)
    assert _stopped(client, stop, stream) == (lowercase_text[:cut], "stop", stop)


@pytest.mark.parametrize("stream", [False, True])
def test_the_earliest_of_several_stop_strings_wins(client, lowercase_text, stream):
    late, early = lowercase_text[20:26], lowercase_text[10:12]
    cut = lowercase_text.find(early)
    assert _stopped(client, [late, early], stream) == (lowercase_text[:cut], "stop", early)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, lowercase_text, stream):
    stop = lowercase_text[12:17]
    end = lowercase_text.find(stop) + len(stop)
    assert _stopped(client, stop, stream, include=True) == (lowercase_text[:end], "stop", stop)


def test_a_stop_string_that_never_appears_holds_nothing_back_at_the_end(client, lowercase_text):
    assert _stopped(client, ["0123456789"], stream=True) == (lowercase_text, "length", None)


def test_streamed_text_never_shows_the_start_of_a_stop_string(client, lowercase_text):
    stop = lowercase_text[15:19]
    cut = lowercase_text.find(stop)
    shown = ""
    for chunk in client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=30,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True, "allowed_token_ids": LOWERCASE},
    ):
        shown += chunk.choices[0].text
        assert len(shown) <= cut


# --- prompt_logprobs, token ids, suffix ---------------------------------------------------


@pytest.mark.parametrize("k", [0, 1])
def test_prompt_logprobs_for_every_prompt_of_a_batch(client, k):
    """§5 item 14."""
    r = client.completions.create(
        model=MODEL,
        prompt=["abcd", "xyz"],
        max_tokens=2,
        extra_body={"prompt_logprobs": k},
    )
    for choice, prompt in zip(r.choices, ["abcd", "xyz"]):
        plp = choice.model_extra["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None
        for entry, token in zip(plp[1:], prompt[1:]):
            assert str(ord(token)) in entry
            assert k <= len(entry) <= k + 1
            assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
            assert entry[str(ord(token))]["decoded_token"] == token


def test_prompt_logprobs_rules(http):
    assert_error(
        http.post("/v1/completions", json={"prompt": "ab", "prompt_logprobs": -1}),
        400,
        "prompt_logprobs",
    )
    assert_error(
        http.post("/v1/completions", json={"prompt": "ab", "prompt_logprobs": 21}),
        400,
        "prompt_logprobs",
    )
    assert_error(
        http.post("/v1/completions", json={"prompt": "ab", "prompt_logprobs": 1, "stream": True}),
        400,
        "prompt_logprobs",
    )


def test_return_token_ids_gives_prompt_and_output_ids(client, http):
    """§5 item 29."""
    r = client.completions.create(
        model=MODEL, prompt="hey", max_tokens=1, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0].model_extra
    assert choice["prompt_token_ids"] == list(b"hey")
    assert len(choice["token_ids"]) == 1
    _, sse = post_stream(
        http,
        "/v1/completions",
        {"prompt": "hey", "max_tokens": 3, "return_token_ids": True, "ignore_eos": True},
    )
    assert sse.events[0]["choices"][0]["prompt_token_ids"] == list(b"hey")
    assert sum(len(e["choices"][0]["token_ids"]) for e in sse.events) == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_token_ids_equal_the_full_ones(http, path):
    """Tokens whose text is held back (partial characters of the byte vocabulary) keep
    their ids."""
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    body |= (
        {"prompt": "abc"} if "chat" not in path else {"messages": [{"role": "u", "content": "x"}]}
    )
    full = http.post(path, json=body).json()["choices"][0]["token_ids"]
    _, sse = post_stream(http, path, body)
    streamed = [t for e in sse.events for c in e["choices"] for t in c.get("token_ids") or []]
    assert streamed == full and len(full) == 24


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    r = client.completions.create(
        model=MODEL,
        prompt="abcdefgh",
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True},
    )
    assert r.choices[0].model_extra["prompt_token_ids"] == list(b"fgh")
    assert r.usage.prompt_tokens == 3


def test_suffix_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", suffix="y", max_tokens=1)
    assert e.value.body["param"] == "suffix"
