"""Issue 4, item 5: every validation rule of the research note (§2.2) is a 4xx with
{"error": {message, type, param, code}} that names the field (and the limit); unknown
models are 404s; nothing a client sends is a 500 or a traceback."""

from __future__ import annotations

import openai
import pytest
from e2e_http import MAX_MODEL_LEN, MODEL, VOCAB_SIZE, assert_error

pytestmark = pytest.mark.timeout(120)

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "x"}]
INT64 = 2**63

# (route, body, param, words the message must contain)
RULES = [
    # prompts
    (C, {}, "prompt", ["Either prompt or prompt_embeds must be provided and non-empty."]),
    (C, {"prompt": ""}, "prompt", ["Either prompt or prompt_embeds"]),
    (C, {"prompt": []}, "prompt", ["Either prompt or prompt_embeds"]),
    (C, {"prompt": [[]]}, "prompt", ["empty"]),
    (C, {"prompt": ["a", ""]}, "prompt", ["empty"]),
    (C, {"prompt": [999999]}, "prompt", ["out of vocabulary", "999999", str(VOCAB_SIZE)]),
    (C, {"prompt": [[1], [VOCAB_SIZE]]}, "prompt", ["out of vocabulary"]),
    (C, {"prompt": [-1]}, "body.prompt", ["greater than or equal to 0"]),
    (C, {"prompt": [[1], [2, -3]]}, "body.prompt", ["greater than or equal to 0"]),
    (C, {"prompt": {"text": "x"}}, "body.prompt", ["string", "token"]),
    (C, {"prompt": [1, "a"]}, "body.prompt", ["string", "token"]),
    (C, {"prompt": "x", "suffix": "y"}, "suffix", ["suffix"]),
    (C, {"prompt": "x", "best_of": 2}, "best_of", ["best_of"]),
    (C, {"prompt": "x", "echo": True, "logprobs": 1, "use_beam_search": True}, "echo", ["beam search", "prompt logprobs"]),
    (C, {"prompt": "x", "stream": True, "use_beam_search": True}, "stream", ["Streaming is not currently supported with beam search"]),
    (C, {"prompt": "x", "use_beam_search": True, "early_stopping": "sometimes"}, "body.early_stopping", ["never"]),
    (C, {"prompt": "x", "use_beam_search": True, "n": 300}, "n", ["--max-num-seqs", "300"]),
    # logprobs
    (C, {"prompt": "x", "logprobs": -1}, "logprobs", ["-1", "whole vocabulary", "--max-logprobs 20"]),
    (C, {"prompt": "x", "logprobs": -2}, "logprobs", ["`logprobs` must be a positive value or -1."]),
    (C, {"prompt": "x", "logprobs": "2"}, "logprobs", ["`logprobs` must be an integer."]),
    (C, {"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs", ["must be an integer"]),
    (C, {"prompt": "x", "logprobs": 2.5}, "body.logprobs", ["integer"]),
    (C, {"prompt": "x", "logprobs": 21}, "logprobs", ["21", "20"]),
    (C, {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", ["-1", "--max-logprobs 20"]),
    (C, {"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs", ["must be a positive value or -1"]),
    (C, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", ["21", "20"]),
    (C, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", ["stream"]),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs", ["21", "20"]),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs", ["-1", "--max-logprobs 20"]),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -2}, "top_logprobs", ["must be a positive value or -1"]),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": "2"}, "top_logprobs", ["must be an integer"]),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs", ["logprobs` must be set to true"]),
    (CHAT, {"messages": MSG, "top_logprobs": -1}, "top_logprobs", ["logprobs` must be set to true"]),
    # sampling ranges
    (C, {"prompt": "x", "n": 0}, "n", ["n", "1"]),
    (C, {"prompt": "x", "n": "two"}, "body.n", ["n"]),
    (C, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", ["2"]),
    (C, {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty", ["-2"]),
    (C, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", ["0"]),
    (C, {"prompt": "x", "temperature": -0.1}, "temperature", ["0"]),
    (C, {"prompt": "x", "top_p": 0}, "top_p", ["0"]),
    (C, {"prompt": "x", "top_p": 1.5}, "top_p", ["1"]),
    (C, {"prompt": "x", "top_k": -2}, "top_k", ["-1"]),
    (C, {"prompt": "x", "min_p": 1.5}, "min_p", ["1"]),
    (C, {"prompt": "x", "max_tokens": -1}, "max_tokens", ["0"]),
    (C, {"prompt": "x", "max_tokens": 0}, "max_tokens", ["echo"]),
    (C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens", ["max_tokens"]),
    (C, {"prompt": "x", "min_tokens": -1}, "min_tokens", ["0"]),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens", ["1"]),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens", ["1"]),
    (C, {"prompt": "x", "stop": [""]}, "stop", ["empty"]),
    (C, {"prompt": "x", "stop": ""}, "stop", ["empty"]),
    (C, {"prompt": "x", "stop": 5}, "body.stop", ["stop"]),
    (C, {"prompt": "x", "seed": INT64}, "body.seed", ["less_than_equal", str(INT64 - 1)]),
    (C, {"prompt": "x", "seed": -INT64 - 1}, "body.seed", ["greater_than_equal"]),
    (C, {"prompt": "x", "priority": INT64}, "body.priority", ["less_than_equal"]),
    (C, {"prompt": "x", "cache_salt": ""}, "cache_salt", ["'cache_salt' must be a non-empty string"]),
    (CHAT, {"messages": MSG, "cache_salt": ""}, "cache_salt", ["non-empty string"]),
    (C, {"prompt": "x", "truncate_prompt_tokens": 1, "truncation_side": "middle"}, "body.truncation_side", ["left", "right"]),
    (C, {"prompt": "x", "top_k": INT64}, "top_k", ["less_than_equal"]),
    (C, {"prompt": "x", "priority": 1}, "priority", ["--scheduling-policy priority"]),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", ["stream"]),
    (C, {"prompt": "x", "structured_outputs": {"regex": "[.*"}}, "structured_outputs.regex", ["Regex"]),
    (C, {"prompt": "x", "guided_json": {"type": "bogus"}}, "guided_json", ["bogus"]),
    # context length
    (C, {"prompt": [1] * MAX_MODEL_LEN}, "input_tokens", [f"maximum context length is {MAX_MODEL_LEN}"]),
    (C, {"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens", [f"max_tokens={MAX_MODEL_LEN + 1} cannot be greater than max_model_len={MAX_MODEL_LEN}"]),
    (C, {"prompt": "x", "max_tokens": 10**30}, "max_tokens", ["cannot be greater than max_model_len"]),
    (CHAT, {"messages": MSG, "max_completion_tokens": MAX_MODEL_LEN + 1}, "max_completion_tokens", ["cannot be greater than max_model_len"]),
    (CHAT, {"messages": MSG, "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens", ["cannot be greater than max_model_len"]),
    (C, {"prompt": [1] * 1000, "max_tokens": 100, "min_tokens": 30}, "min_tokens", ["min_tokens must be less than or equal to max_tokens=24, got 30."]),
    (CHAT, {"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]}, "input_tokens", ["maximum context length"]),
    (C, {"prompt": "x", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens", [str(MAX_MODEL_LEN)]),
    (C, {"prompt": "x", "truncate_prompt_tokens": -2}, "body.truncate_prompt_tokens", ["-1"]),
    (C, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ["empty"]),
    # token ids against the vocabulary
    (C, {"prompt": "x", "logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias", [str(VOCAB_SIZE)]),
    (C, {"prompt": "x", "logit_bias": {"the": 1}}, "logit_bias", ["token ids"]),
    (C, {"prompt": "x", "logit_bias": {"the": 1, "a": 2, "3": 1}}, "logit_bias", ["['the', 'a']"]),
    (C, {"prompt": "x", "logit_bias": {str(VOCAB_SIZE): 1, "-5": 1, "7": 1}}, "logit_bias", [f"[{VOCAB_SIZE}, -5]"]),
    (C, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(-30, 0)}}, "logit_bias", ["-30", "and 10 more"]),
    (C, {"prompt": "x", "logit_bias": {"1": "high"}}, "body.logit_bias.1", ["number"]),
    (C, {"prompt": "x", "stop_token_ids": [VOCAB_SIZE + 1]}, "stop_token_ids", [str(VOCAB_SIZE + 1)]),
    (C, {"prompt": "x", "stop_token_ids": [-1, VOCAB_SIZE]}, "stop_token_ids", [f"[-1, {VOCAB_SIZE}]"]),
    (C, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", ["empty"]),
    # chat
    (CHAT, {}, "body.messages", ["messages"]),
    (CHAT, {"messages": []}, "body.messages", ["at least 1"]),
    (CHAT, {"messages": "hi"}, "body.messages", ["list"]),
    (CHAT, {"messages": [{"content": "x"}]}, "body.messages.0.role", ["role"]),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "body.messages.0.content", ["content"]),
    (CHAT, {"messages": MSG, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", ["add_generation_prompt"]),
    (CHAT, {"messages": MSG, "chat_template": "{{ x }}"}, "chat_template", ["--trust-request-chat-template"]),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", ["tokenize"]),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"tools": 5}}, "messages", ["chat template"]),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format", ["json_schema"]),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, "body.response_format.type", ["text"]),
    (CHAT, {"messages": MSG, "tool_choice": "auto"}, "tool_choice", ["tools"]),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", ["--enable-auto-tool-choice"]),
    (CHAT, {"messages": MSG, "logprobs": "maybe"}, "body.logprobs", ["bool"]),
    # /tokenize, /detokenize
    ("/tokenize", {}, "prompt", ["prompt", "messages"]),
    ("/tokenize", {"prompt": "x", "messages": MSG}, "prompt", ["exactly one"]),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"tools": 5}}, "messages", ["chat template"]),
    ("/detokenize", {}, "body.tokens", ["tokens"]),
    ("/detokenize", {"tokens": [VOCAB_SIZE]}, "tokens", ["out of vocabulary"]),
    ("/detokenize", {"tokens": ["a"]}, "body.tokens.0", ["integer"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param", "words"), RULES, ids=[f"{r[0]}:{r[2]}" for r in RULES]
)
def test_a_rule_violation_is_a_400_naming_the_field(http, path, body, param, words):
    """`param` as vLLM names it: `body.<field>` where its request model refuses the
    value (with vLLM's type "Bad Request"), the bare field where a later check does."""
    error = assert_error(http.post(path, json=body), 400, param, words)
    assert error["type"] == ("Bad Request" if param.startswith("body.") else "BadRequestError")


def test_streamed_requests_fail_validation_before_the_stream_starts(http):
    r = http.post(C, json={"prompt": "x", "n": 0, "stream": True})
    assert_error(r, 400, "n")


@pytest.mark.parametrize("path", [C, CHAT, "/tokenize", "/detokenize", "/invocations"])
def test_malformed_bodies_are_400s(http, path):
    json_headers = {"content-type": "application/json"}
    for raw in [b"", b"{", b"[1, 2]", b'"text"', b"null", b'{"a": NaN}', b'{"a": "\\ud800"}']:
        assert_error(http.post(path, content=raw, headers=json_headers), 400)
    r = http.post(path, content=b"prompt=x", headers={"content-type": "text/plain"})
    assert_error(r, range(400, 500))


def test_a_form_body_is_a_4xx_for_the_sdk(client):
    """§5 item 4."""
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=MSG,
            extra_headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
    assert 400 <= e.value.status_code < 500


def test_an_unknown_model_is_a_404_not_found(client, http):
    """§5 item 9."""
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model"
    assert "The model `gpt-4` does not exist." in e.value.body["message"]
    for path, body in [(CHAT, {"messages": MSG}), ("/tokenize", {"prompt": "x"})]:
        assert_error(http.post(path, json=body | {"model": "gpt-4"}), 404, "model")


def test_unknown_fields_are_ignored(http):
    r = http.post(C, json={"prompt": "x", "max_tokens": 1, "frobnicate": {"a": [1]}})
    assert r.status_code == 200
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 1, "user": "u1", "x": None})
    assert r.status_code == 200


def test_null_means_the_default_for_vllms_optional_fields(http):
    body = {"prompt": "x", "max_tokens": None, "n": None, "stream": None, "echo": None}
    r = http.post(C, json=body | {"ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_the_sdk_maps_errors_to_its_exception_types(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=0)
    assert e.value.status_code == 400 and e.value.body["type"] == "BadRequestError"
    assert e.value.body["code"] == 400


def test_header_values_are_validated_too(http):
    body = {"prompt": "x", "max_tokens": 1}
    for header, value in [
        ("X-data-parallel-rank", "1"),
        ("X-data-parallel-rank", "zero"),
        ("X-Priority", "1e3"),
        ("X-Priority", str(2**63)),
    ]:
        r = http.post(C, json=body, headers={header: value})
        assert_error(r, 400, header.lower() if "Priority" in header else header, [value])
    assert http.post(C, json=body, headers={"X-data-parallel-rank": "0"}).status_code == 200
