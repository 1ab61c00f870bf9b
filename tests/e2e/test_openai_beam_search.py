"""Issue 16, item 13: `use_beam_search` through the official openai client, completions and
chat, as vLLM answers it: `n` beams, the n best returned best first; chat may stream (every
choice at the end), completions may not; vLLM's refusals are 400s."""

from __future__ import annotations

import httpx
import pytest
from e2e_http import EOS, MODEL, assert_error, engine_stats, parse_sse
from zserve_proc import wait_for

pytestmark = pytest.mark.timeout(120)

BEAMS = {"use_beam_search": True, "ignore_eos": True}
MSG = [{"role": "user", "content": "Say something"}]


def beam_complete(client, n: int, **kwargs):
    extra = {**BEAMS, **kwargs.pop("extra_body", {})}
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("prompt", "Once upon")
    return client.completions.create(model=MODEL, n=n, extra_body=extra, **kwargs)


def test_n_beams_come_back_distinct_and_best_first(client):
    r = beam_complete(client, 4, logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 4
    # Equal lengths: the length penalty keeps the order of the summed logprobs.
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums == sorted(sums, reverse=True)
    for c in r.choices:
        assert c.finish_reason == "length"
        assert len(c.logprobs.tokens) == 8
        assert all(len(top) in (2, 3) for top in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == 4 * 8
    assert r.usage.prompt_tokens == len("Once upon")


def test_one_beam_is_greedy(client):
    greedy = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    # Beam search ranks by the model's own probabilities: temperature plays no part.
    beam = beam_complete(client, 1, temperature=1.5)
    assert beam.choices[0].text == greedy.choices[0].text


def test_echo_of_no_tokens_is_one_choice_per_prompt_as_in_vllm(client):
    r = beam_complete(client, 3, prompt=["Once upon", "Far away"], max_tokens=0, echo=True)
    assert [(c.index, c.text) for c in r.choices] == [(0, "Once upon"), (1, "Far away")]


def test_each_prompt_gets_its_n_beams(client):
    r = beam_complete(client, 2, prompt=["Once upon", "Far away"])
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [beam_complete(client, 2, prompt=p) for p in ("Once upon", "Far away")]
    assert [c.text for c in r.choices] == [c.text for a in alone for c in a.choices]


# On this prompt the tiny llama's best beam is the EOS alone (engine_oracle.make_prompts).
EOS_FIRST = [197, 215, 20, 132, 248]


def test_an_eos_ends_a_beam_without_showing(client):
    """As in vLLM, the EOS is neither text nor (without include_stop_str_in_output) a
    token of the answer, nor counted in usage."""
    extra = {"ignore_eos": False, "return_token_ids": True}
    r = beam_complete(client, 3, prompt=EOS_FIRST, max_tokens=12, extra_body=extra)
    best = r.choices[0]
    assert (best.finish_reason, best.stop_reason, best.text, best.token_ids) == (
        "stop",
        None,
        "",
        [],
    )
    assert [c.finish_reason for c in r.choices[1:]] == ["length", "length"]
    assert r.usage.completion_tokens == 24
    extra["include_stop_str_in_output"] = True
    kept = beam_complete(client, 3, prompt=EOS_FIRST, max_tokens=12, extra_body=extra)
    assert (kept.choices[0].text, kept.choices[0].token_ids) == ("", [EOS])


def test_stop_token_ids_finish_beams(client):
    first = beam_complete(client, 3, extra_body={"return_token_ids": True}).choices[0]
    token = first.token_ids[2]
    r = beam_complete(client, 3, extra_body={"stop_token_ids": [token], "return_token_ids": True})
    best = r.choices[0]
    assert best.finish_reason == "stop" and best.stop_reason == token
    kept = beam_complete(
        client,
        3,
        extra_body={
            "stop_token_ids": [token],
            "include_stop_str_in_output": True,
            "return_token_ids": True,
        },
    )
    assert kept.choices[0].token_ids == best.token_ids + [token]


def test_chat_beams_answer_and_stream(client, http):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=6,
        n=3,
        logprobs=True,
        top_logprobs=2,
        extra_body=BEAMS,
    )
    assert len({c.message.content for c in r.choices}) == 3
    assert all(len(c.logprobs.content) == 6 for c in r.choices)
    body = {
        "model": MODEL,
        "messages": MSG,
        "max_tokens": 6,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        **BEAMS,
    }
    sse = parse_sse(http.post("/v1/chat/completions", json=body).text)
    assert sse.done
    texts = {}
    for event in sse.events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"].get("content", "")
    assert texts == {i: c.message.content for i, c in enumerate(r.choices)}
    assert sse.events[-1]["usage"]["completion_tokens"] == 18


def test_what_vllm_refuses_is_a_400(http):
    C = "/v1/completions"
    base = {"model": MODEL, "prompt": "x", "use_beam_search": True}
    assert_error(http.post(C, json={**base, "stream": True}), 400, "stream", ["beam search"])
    assert_error(http.post(C, json={**base, "echo": True, "logprobs": 1}), 400, "echo")
    r = http.post(C, json={**base, "logprobs": 1, "logprob_token_ids": [1]})
    assert_error(r, 400, "logprob_token_ids", ["beam search"])
    # Within the width limit (128 sequences on the CPU) but not the cache: 128 beams over
    # the whole context (1,024 tokens) may need 128 x 64 blocks, one more than the server
    # counts on (its 64 MiB hold 8,192, one kept spare).
    r = http.post(C, json={**base, "prompt": [7], "n": 128, "max_tokens": 1023})
    assert_error(r, 400, "n", ["KV blocks"])


def server_info(server) -> dict:
    return httpx.get(server.base_url + "/server_info", timeout=10).json()["engines"][0]


def test_a_search_weighs_its_width_and_a_client_that_leaves_frees_it(default_server, http):
    """While it runs, a search of n beams is n sequences in the engine and in the load the
    API server balances by; a client that leaves aborts it and every count returns to 0."""
    aborted = engine_stats(default_server)["num_aborted"]
    body = {"model": MODEL, "messages": MSG, "n": 4, "max_tokens": 900, "stream": True, **BEAMS}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        wait_for(
            lambda: (
                (e := server_info(default_server))["in_flight"] == 4
                and e["stats"]["num_running"] == 4
                and e["stats"]["num_requests_by_client"] == [4]
            ),
            what="the search to run",
        )
    wait_for(lambda: engine_stats(default_server)["num_aborted"] == aborted + 1, what="abort")
    wait_for(
        lambda: (
            (e := server_info(default_server))["in_flight"] == 0
            and e["stats"]["num_running"] == 0
            and e["stats"]["num_requests_by_client"] == [0]
        ),
        what="the counts to settle",
    )
    stats = engine_stats(default_server)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
