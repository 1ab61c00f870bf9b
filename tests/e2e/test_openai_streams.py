"""Issue 4, items 6 and 10 on default flags: SSE framing, client disconnects (streaming or
not) abort in the engine, and the event loop stays free while hundreds of streams run.
Keep-alive comments and errors after HTTP 200 need flags or a dying engine: they are in
test_openai_transport.py."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import orjson
import pytest
from e2e_http import (
    MODEL,
    async_client,
    engine_stats,
    parse_sse,
    post_stream,
    raw_exchange,
)
from zserve_proc import wait_for

pytestmark = pytest.mark.timeout(180)

LONG = {"max_tokens": 900, "min_tokens": 900, "ignore_eos": True}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "abc", "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}),
    ],
)
def test_sse_framing(http, path, body):
    r, sse = post_stream(http, path, body | {"max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert sse.done and sse.events and sse.comments == []  # keep-alive is off by default
    assert len({e["id"] for e in sse.events}) == 1
    assert len({e["created"] for e in sse.events}) == 1
    assert all(len(e["choices"]) == 1 for e in sse.events)
    if "chat" not in path:  # completions choices carry every key, nulls included
        keys = {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        keys |= {"prompt_token_ids", "token_ids"}
        assert all(keys <= set(e["choices"][0]) for e in sse.events)
    else:
        assert all(
            "token_ids" in e["choices"][0]
            for e in sse.events
            if "role" not in e["choices"][0]["delta"]
        )
    # As vLLM 0.32's chunks: no usage key at all unless usage was asked for.
    assert all("usage" not in e for e in sse.events)


def http_chunks(server, path: str, body: dict) -> list[bytes]:
    """The response body's HTTP/1.1 chunks as the server framed them (one per write)."""
    payload = orjson.dumps(body)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n"
    data = raw_exchange(server, head.encode() + payload, wait_s=60)
    headers, rest = data.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding: chunked" in headers.lower()
    assert rest.endswith(b"\r\n0\r\n\r\n"), f"the body did not end: {rest[-200:]!r}"
    chunks = []
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if int(size, 16) == 0:
            return chunks
        chunks.append(rest[: int(size, 16)])
        rest = rest[int(size, 16) + 2 :]


def test_a_stream_ends_with_its_last_chunk_usage_and_done_in_one_write(default_server):
    """The last tokens' chunk, the usage chunk and [DONE] leave in one write with the
    body's end (one segment for the client to read, not four). How the events before
    them are cut into writes depends on how far the engine ran ahead of the stream,
    so the test counts the token ids they carry, not the writes."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    chunks = http_chunks(default_server, "/v1/completions", body | {"return_token_ids": True})
    tail = parse_sse(chunks[-1].decode())
    assert tail.done and len(tail.events) >= 2
    *_, finishing, usage = tail.events
    assert finishing["choices"][0]["finish_reason"] == "length" and not usage["choices"]
    assert usage["usage"]["completion_tokens"] == 6
    events = parse_sse(b"".join(chunks).decode()).events[:-1]
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 6


def test_a_streaming_client_that_disconnects_aborts_its_request(default_server):
    before = engine_stats(default_server)["num_aborted"]
    with httpx.Client(base_url=default_server.base_url, timeout=30) as c:
        body = {"prompt": "abc", "stream": True, **LONG}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    wait_for(
        lambda: (
            engine_stats(default_server)["num_aborted"] == before + 1
            and engine_stats(default_server)["num_running"] == 0
        ),
        what="the engine to abort the stream's request",
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streaming_client_that_disconnects_aborts_its_request(default_server, path):
    before = engine_stats(default_server)["num_aborted"]
    body = (
        {"prompt": "abc"} if "chat" not in path else {"messages": [{"role": "u", "content": "x"}]}
    )
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        # 900 tokens take the tiny model ~0.5 s or more even alone; give up after 0.15 s
        httpx.post(default_server.base_url + path, json=body | LONG, timeout=0.15)
    wait_for(
        lambda: (
            engine_stats(default_server)["num_aborted"] == before + 1
            and engine_stats(default_server)["num_running"] == 0
        ),
        what="the engine to abort the request",
    )
    # 900 tokens take several seconds; the abort came long before that... or not at all.
    assert engine_stats(default_server)["generation_tokens"] > 0
    assert time.monotonic() - started < 30


def test_health_answers_while_200_streams_run_and_their_cancellation_frees_the_engine(
    default_server,
):
    """Item 10, and §5 item 5: 200 clients give up; the server serves the next one."""
    n = 200

    async def run() -> tuple[int, int, list[int]]:
        async with (
            async_client(default_server, timeout=0.5) as impatient,
            httpx.AsyncClient(
                base_url=default_server.base_url,
                timeout=30,
                limits=httpx.Limits(max_connections=n + 10),
            ) as http,
        ):
            started = asyncio.Event()
            count = 0

            async def stream(i: int) -> None:
                nonlocal count
                body = {"prompt": [65 + i % 26] * 8, "stream": True, **LONG}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            count += 1
                            if count >= n:
                                started.set()
                            break
                    await asyncio.sleep(3600)  # hold the stream open until cancelled

            tasks = [asyncio.create_task(stream(i)) for i in range(n)]
            await asyncio.wait_for(started.wait(), 120)
            # What the engine runs, read first: the streams that started early finish
            # around the time the last one starts (43-99 still ran at this read, 8-28
            # twenty milliseconds later), so a read after the health checks raced them.
            running = (await http.get("/server_info")).json()["engines"][0]["stats"]
            health = [(await http.get("/health")).status_code for _ in range(5)]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

            async def give_up(i: int) -> None:
                with pytest.raises(openai.APITimeoutError):
                    await impatient.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"hi {i}"}],
                        max_tokens=900,
                        extra_body={"min_tokens": 900},
                    )

            await asyncio.gather(*(give_up(i) for i in range(n)))
            return running["num_running"] + running["num_waiting"], count, health

    in_engine, count, health = asyncio.run(run())
    assert count >= 200 and in_engine > 0
    assert health == [200] * 5
    wait_for(
        lambda: (
            engine_stats(default_server)["num_running"] == 0
            and engine_stats(default_server)["num_waiting"] == 0
        ),
        timeout=60,
        what="every cancelled request to leave the engine",
    )
    with openai.OpenAI(
        base_url=default_server.base_url + "/v1", api_key="x", max_retries=0, timeout=5
    ) as patient:
        r = patient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert len(r.choices) == 1


def test_a_long_prompt_is_tokenized_off_the_event_loop(default_server, http):
    """A prompt of a million characters keeps the loop free for /health meanwhile."""

    async def run() -> tuple[int, list[int]]:
        async with httpx.AsyncClient(base_url=default_server.base_url, timeout=60) as c:
            big = c.post("/v1/completions", json={"prompt": "ab" * 500_000, "max_tokens": 1})
            task = asyncio.create_task(big)
            health = [(await c.get("/health")).status_code for _ in range(3)]
            return (await task).status_code, health

    status, health = asyncio.run(run())
    assert status == 400 and health == [200, 200, 200]  # far beyond the context: a 400
    sse = parse_sse(
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}).text
    )
    assert sse.done
