"""New connections spread over API servers; thousands of streams on one API server
(issue 5, items 1 and 9)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
from zserve_proc import ZServe, server_info, wait_for

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"


def test_800_new_connections_spread_within_25_percent_over_4_api_servers(tiny_model):
    with ZServe(
        str(tiny_model("llama")),
        "--served-model-name",
        MODEL,
        "--api-server-count",
        "4",
        "--kv-cache-memory-bytes",
        "32MiB",
        "--enable-dev-routes",  # /server_info
    ) as server:
        counts = collections.Counter()
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            for _ in range(800):
                r = client.get("/server_info", headers={"Connection": "close"})
                counts[r.json()["api_server_index"]] += 1
        print(f"800 connections over 4 API servers: {dict(sorted(counts.items()))}")
        assert set(counts) == {0, 1, 2, 3}
        assert all(150 <= n <= 250 for n in counts.values()), counts


async def _open_stream(
    port: int, max_tokens: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = (
        f'{{"model":"{MODEL}","prompt":"s","max_tokens":{max_tokens},'
        f'"ignore_eos":true,"stream":true}}'
    ).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    status = await reader.readline()
    assert status.startswith(b"HTTP/1.1 200"), status
    return reader, writer


def _events(body: bytes) -> list[dict]:
    """The JSON events of a raw HTTP/1.1 SSE response (headers, chunked framing and all)."""
    return [
        json.loads(line[len(b"data: ") :])
        for line in body.split(b"\n")
        if line.startswith(b"data: {")
    ]


async def _read_to_done(reader: asyncio.StreamReader) -> bytes:
    data = b""
    while b"data: [DONE]" not in data:
        chunk = await reader.read(65536)
        if not chunk:
            break
        data += chunk
    return data


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_2000_concurrent_streams_on_one_api_server(small_model):
    # Every running slot holds a long blocker while the 2,000 streams open (HTTP 200
    # sent) and wait in the engine's queue, so they are truly concurrent; closing the
    # blockers aborts them and lets the 2,000 run.
    slots = 256
    with ZServe(
        str(small_model),
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        str(slots),
        "--kv-cache-memory-bytes",
        "512MiB",
        "--disable-log-requests",
        "--enable-dev-routes",  # /server_info
    ) as server:
        api_pid = server_info(server.base_url)["pid"]
        rss_before = _rss_kib(api_pid)

        async def run() -> tuple[int, list[bytes]]:
            blockers = await asyncio.gather(
                *[_open_stream(server.port, 4000) for _ in range(slots)]
            )
            t1 = time.monotonic()
            streams = await asyncio.gather(*[_open_stream(server.port, 2) for _ in range(2000)])
            print(f"PHASE blockers {t1 - t0:.1f} s, 2000 open {time.monotonic() - t1:.1f} s")
            open_now = len(streams)
            for _, w in blockers:
                w.close()
            bodies = await asyncio.gather(*[_read_to_done(r) for r, _ in streams])
            for _, w in streams:
                w.close()
            return open_now, bodies

        t0 = time.monotonic()
        open_now, bodies = asyncio.run(run())
        took = time.monotonic() - t0
        peak = _rss_kib(api_pid, "VmHWM")
        print(
            f"2000 streams held at once; all done in {took:.1f} s; API server RSS "
            f"{rss_before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB"
        )
        assert open_now == 2000
        assert all(b.count(b'"finish_reason":"length"') == 1 for b in bodies)
        assert all(b"data: [DONE]" in b for b in bodies)
        # Parsed, not grepped: a sampled token "error" streams as "text":"error".
        errors = [e for b in bodies for e in _events(b) if "error" in e]
        assert not errors, errors[:3]
        assert peak - rss_before < 400 * 1024  # well under 200 KiB per open stream


def test_a_slow_reader_is_held_back_by_flow_control(tiny_model):
    """A client that stops reading: the server stops writing (the socket buffers fill)
    and keeps only that request's own tokens; nothing else grows."""
    with ZServe(
        str(tiny_model("llama")),
        "--served-model-name",
        MODEL,
        "--kv-cache-memory-bytes",
        "64MiB",
        "--enable-dev-routes",  # /server_info
    ) as server:
        api_pid = server_info(server.base_url)["pid"]
        rss_before = _rss_kib(api_pid)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        body = (
            f'{{"model":"{MODEL}","prompt":"s","max_tokens":1000,"ignore_eos":true,'
            f'"stream":true,"logprobs":5}}'
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        # the engine finishes the request while the client reads nothing
        wait_for(
            lambda: (
                server_info(server.base_url)["engines"][0]["stats"]["generation_tokens"] >= 1000
            ),
            "the engine to generate the answer",
            timeout=60,
            interval=0.2,
        )
        time.sleep(1.0)
        grown = _rss_kib(api_pid) - rss_before
        data = b""
        sock.settimeout(30)
        while b"data: [DONE]" not in data:
            chunk = sock.recv(65536)
            assert chunk
            data += chunk
        sock.close()
        events = data.count(b"data: {")
        print(f"slow reader: API server grew {grown} KiB while 1000 tokens waited unread")
        assert events == 1000  # nothing lost while the reader was slow
        assert grown < 64 * 1024


def _allowed_cpus(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]
    raise KeyError(pid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_engine_and_api_server_cpus_are_pinned_as_asked(tiny_model):
    cpus = sorted(os.sched_getaffinity(0))
    with ZServe(
        str(tiny_model("llama")),
        "--served-model-name",
        MODEL,
        "--engine-cpus",
        str(cpus[1]),
        "--api-server-cpus",
        str(cpus[0]),
        "--kv-cache-memory-bytes",
        "32MiB",
        "--enable-dev-routes",  # /server_info
    ) as server:
        info = server_info(server.base_url)
        assert _allowed_cpus(info["engines"][0]["pid"]) == str(cpus[1])
        assert _allowed_cpus(info["pid"]) == str(cpus[0])
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": MODEL, "prompt": "pinned", "max_tokens": 3},
        )
        assert r.status_code == 200
