"""Issue 4, item 3: /v1/chat/completions through the official client and raw HTTP, on the
tiny llama's ChatML template. --chat-template and --trust-request-chat-template are in
test_openai_flags.py."""

from __future__ import annotations

import asyncio

import openai
import pytest
from e2e_http import MAX_MODEL_LEN, MODEL, assert_error, async_client, post_stream

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "Say hi"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LOWERCASE = list(range(ord("a"), ord("z") + 1))


def chatml_len(messages: list[dict], add_generation_prompt: bool = True) -> int:
    """Tokens of the tiny model's ChatML rendering (one token per byte or special)."""
    n = sum(1 + len(f"{m['role']}\n{m['content']}".encode()) + 2 for m in messages)
    return n + (1 + len(b"assistant\n") if add_generation_prompt else 0)


def test_a_chat_completion_has_exact_usage_and_logprobs(client):
    """§5 item 30."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=5,
        **GREEDY,
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert r.usage.prompt_tokens == chatml_len(USER)
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (5, r.usage.prompt_tokens + 5)
    assert len(choice.logprobs.content) == 5
    assert all(len(t.top_logprobs) == 5 for t in choice.logprobs.content)
    assert all(t.logprob >= -9999.0 for t in choice.logprobs.content)
    follow_up = client.chat.completions.create(
        model=MODEL,
        messages=[*USER, {"role": "assistant", "content": choice.message.content}, *USER],
        max_completion_tokens=3,
    )
    assert follow_up.choices[0].message.content is not None


def test_max_completion_tokens_wins_over_max_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, max_completion_tokens=6, **GREEDY
    )
    assert r.usage.completion_tokens == 6
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **GREEDY)
    assert r.usage.completion_tokens == 4


def test_max_tokens_defaults_to_the_rest_of_the_context(client):
    """§5 item 47 (a long prompt leaves a short rest, to keep the test quick)."""
    messages = [{"role": "user", "content": "z" * (MAX_MODEL_LEN - 30)}]
    r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == chatml_len(messages)
    assert r.usage.total_tokens == MAX_MODEL_LEN


def test_chat_logprobs_switches(client):
    """§5 item 31."""
    kwargs = dict(model=MODEL, messages=USER, max_completion_tokens=3, **GREEDY)
    assert client.chat.completions.create(**kwargs, logprobs=False).choices[0].logprobs is None
    zero = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=0)
    assert all(t.top_logprobs == [] for t in zero.choices[0].logprobs.content)
    plain = client.chat.completions.create(**kwargs, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)
    top = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=20)
    content = top.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 20 for t in content)
    # Greedy: the chosen token heads its own top list.
    assert all(t.top_logprobs[0].logprob == t.logprob for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_too_many_top_logprobs_is_refused_and_the_server_keeps_serving(client, http):
    """§5 item 32."""
    for stream in (False, True):
        body = {"messages": USER, "logprobs": True, "top_logprobs": 21, "stream": stream}
        assert_error(http.post("/v1/chat/completions", json=body), 400, "top_logprobs", ["21"])
    body = {"messages": USER, "top_logprobs": 2}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "top_logprobs")
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1).choices


def test_prompt_logprobs_are_top_level_and_sized_by_the_request(client):
    """§5 item 33."""
    kwargs = dict(model=MODEL, messages=USER, max_completion_tokens=1)
    assert client.chat.completions.create(**kwargs).model_extra["prompt_logprobs"] is None
    for k in (1, 2):
        r = client.chat.completions.create(**kwargs, extra_body={"prompt_logprobs": k})
        plp = r.model_extra["prompt_logprobs"]
        assert len(plp) == r.usage.prompt_tokens and plp[0] is None
        assert all(k <= len(entry) <= k + 1 for entry in plp[1:])


def test_text_parts_custom_roles_and_extra_keys_behave_like_plain_strings(client):
    """§5 items 38, 39."""
    kwargs = dict(model=MODEL, max_completion_tokens=6, **GREEDY)
    plain = client.chat.completions.create(
        messages=[{"role": "tester", "content": "hello there"}], **kwargs
    )
    parts = client.chat.completions.create(
        messages=[
            {
                "role": "tester",
                "content": [{"type": "text", "text": "hello there"}],
                "unknown_key": {"x": 1},
            }
        ],
        **kwargs,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_image_and_audio_parts_are_a_clear_400(http, part):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]}
    assert_error(
        http.post("/v1/chat/completions", json=body),
        400,
        "messages.0.content",
        [part["type"], "text"],
    )


def test_chat_template_kwargs_reach_the_template(client):
    kwargs = dict(model=MODEL, messages=USER, max_completion_tokens=1)
    plain = client.chat.completions.create(**kwargs)
    off = client.chat.completions.create(
        **kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens + len("<think>\n\n</think>\n\n")


def test_a_request_chat_template_needs_the_trust_flag(http):
    body = {"messages": USER, "chat_template": "{{ messages[0].content }}"}
    assert_error(
        http.post("/v1/chat/completions", json=body), 400, "chat_template", ["--trust-request"]
    )
    body = {"messages": USER, "chat_template_kwargs": {"chat_template": "x"}}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "chat_template")


def test_continue_final_message_with_and_without_echo(client):
    """§5 item 42."""
    prefix = "Sure, the answer is"
    messages = [*USER, {"role": "assistant", "content": prefix}]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_completion_tokens=5,
        temperature=0,
    )
    plain = client.chat.completions.create(
        **kwargs,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    echoed = client.chat.completions.create(
        **kwargs,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    assert plain.usage.prompt_tokens == chatml_len(messages, False) - 2  # no <|im_end|>\n
    assert not plain.choices[0].message.content.startswith(prefix)
    assert echoed.choices[0].message.content == prefix + plain.choices[0].message.content
    assert echoed.choices[0].finish_reason in ("stop", "length")


def test_add_generation_prompt_false_leaves_the_assistant_header_out(client):
    kwargs = dict(model=MODEL, messages=USER, max_completion_tokens=1)
    r = client.chat.completions.create(**kwargs, extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == chatml_len(USER, add_generation_prompt=False)
    assert r.choices[0].message.role == "user"  # the role of the last message


def test_continue_final_message_and_add_generation_prompt_conflict(http):
    body = {"messages": USER, "continue_final_message": True, "add_generation_prompt": True}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "continue_final_message")


def test_echo_streams_the_last_message_first(http):
    messages = [*USER, {"role": "assistant", "content": "Hi"}]
    body = {
        "messages": messages,
        "max_tokens": 3,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    _, sse = post_stream(http, "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in sse.events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas).startswith("Hi")


def test_response_format_text_is_no_constraint_and_json_schema_needs_its_schema(client, http):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, response_format={"type": "text"}
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    body = {"messages": USER, "response_format": {"type": "json_schema"}}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "response_format")
    body = {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}}
    assert_error(
        http.post("/v1/chat/completions", json=body), 400, "response_format.json_schema.schema"
    )


def test_tool_choice_auto_needs_the_server_flags_and_the_others_need_tools(http):
    """Structured outputs and tools are tested in test_structured_outputs.py and
    test_tool_calling.py, on a server started with the tool flags."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, words in [
        ({"tools": [tool]}, ["--enable-auto-tool-choice"]),
        ({"tools": [tool], "tool_choice": "auto"}, ["--tool-call-parser"]),
        ({"tool_choice": "required"}, ["tools"]),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, ["tools"]),
    ]:
        body = {"messages": USER, **extra}
        error = assert_error(http.post("/v1/chat/completions", json=body), 400, contains=words)
        assert error["param"].startswith("tool_choice"), error
    body = {"messages": USER, "tool_choice": "none", "max_tokens": 1, "tools": [tool]}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# --- streaming --------------------------------------------------------------------------


def test_a_stream_starts_with_the_role_and_equals_the_full_response(client):
    """§5 item 34."""
    kwargs = dict(model=MODEL, messages=USER, max_completion_tokens=10, **GREEDY)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id == chunks[-1].id
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason] == ["length"]


def test_streamed_logprobs_equal_the_full_ones_even_when_text_is_held_back(client):
    base = dict(model=MODEL, messages=USER, max_completion_tokens=20, logprobs=True, top_logprobs=2)
    bias = {"ignore_eos": True, "allowed_token_ids": LOWERCASE}
    text = client.chat.completions.create(**base, temperature=0, extra_body=bias)
    stop = text.choices[0].message.content[12:16]
    full = client.chat.completions.create(**base, temperature=0, stop=stop, extra_body=bias)
    chunks = list(
        client.chat.completions.create(
            **base, temperature=0, stop=stop, stream=True, extra_body=bias
        )
    )
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [
        (t.token, t.logprob) for t in full.choices[0].logprobs.content
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"


def test_n_samples_differ_and_stream_to_every_index(client, default_server):
    """§5 item 36."""
    kwargs = dict(model=MODEL, messages=USER, max_completion_tokens=8, temperature=1.0)
    r = client.chat.completions.create(**kwargs, n=3, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3

    async def stream_two():
        async with async_client(default_server) as c:
            stream = await c.chat.completions.create(
                **kwargs,
                n=2,
                seed=5,
                stream=True,
                extra_body={"ignore_eos": True, "allowed_token_ids": LOWERCASE},
            )
            texts: dict[int, str] = {}
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            return texts

    texts = asyncio.run(stream_two())
    assert sorted(texts) == [0, 1] and all(texts.values())


def test_seed_outside_int64_is_a_400(client):
    """§5 item 37."""
    for seed, phrase in [(-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=USER, seed=seed, max_tokens=1)
        assert phrase in e.value.body["message"] and e.value.body["param"] == "body.seed"
