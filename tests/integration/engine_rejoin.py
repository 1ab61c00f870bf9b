"""What tests of --engine-restart-policy on-failure share, whatever runs the engines:
kill one engine mid-stream and watch it re-join the API servers that kept running."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from test_failures import MODEL, StreamReader, _health
from zserve_proc import ZServe, server_info, wait_for


def engine(base_url: str, rank: int) -> dict:
    return server_info(base_url)["engines"][rank]


def api_server_pids(server: ZServe, count: int) -> set[int]:
    """Every API server's pid, as /server_info reports them (the kernel spreads new
    connections over them, so ask until each has answered)."""
    pids: set[int] = set()
    deadline = time.monotonic() + 30
    while len(pids) < count and time.monotonic() < deadline:
        with httpx.Client(base_url=server.base_url) as c:  # a new connection each time
            pids.add(c.get("/server_info").json()["pid"])
    assert len(pids) == count, pids
    return pids


def engines_served(base_url: str, requests: int = 12) -> set[str]:
    ranks = set()
    for i in range(requests):
        r = httpx.post(
            base_url + "/v1/completions",
            json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        ranks.add(r.headers["x-engine-rank"])
    return ranks


def kill_mid_stream_and_rejoin(
    server: ZServe, rank: int, kill: Callable[[dict], None], api_servers: int
) -> tuple[dict, dict]:
    """Stream from engine `rank`, kill it with `kill(its /server_info entry)`: the stream
    ends with an error naming it, /health turns 503, then the engine's next incarnation
    re-joins the same API servers and /health is 200 again. (before, after) entries."""
    api_before = api_server_pids(server, api_servers)
    before = engine(server.base_url, rank)
    reader = StreamReader(server.base_url, headers={"X-data-parallel-rank": str(rank)})
    reader.start()
    assert reader.started.wait(30)
    kill(before)
    wait_for(lambda: _health(server.base_url) == 503, timeout=30)
    reader.join(30)
    assert reader.lines[-1] == "data: [DONE]", reader.lines[-3:]
    assert '"error"' in reader.lines[-2] and f"engine {rank}" in reader.lines[-2]

    def back_everywhere() -> bool:  # several answers in a row, from any API server
        entries = [engine(server.base_url, rank) for _ in range(api_servers * 4)]
        return all(e["alive"] and e["incarnation"] == before["incarnation"] + 1 for e in entries)

    wait_for(back_everywhere, timeout=120, interval=0.2)
    assert _health(server.base_url) == 200
    after = engine(server.base_url, rank)
    assert after["pid"] != before["pid"]
    assert server.proc.poll() is None
    assert api_server_pids(server, api_servers) == api_before  # none was restarted
    return before, after
