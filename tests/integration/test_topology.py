"""The full process shape of DESIGN.md: one port, N API servers, M engines, full mesh."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
from zserve_proc import ZServe, listening_ports, port_is_free, server_info, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def mesh(tiny_model):
    with ZServe(
        str(tiny_model("llama")),
        "--served-model-name",
        "tiny",
        "--api-server-count",
        "2",
        "--data-parallel-size",
        "2",
        "--kv-cache-memory-bytes",
        "64MiB",
        "--enable-dev-routes",  # /server_info
    ) as s:
        yield s


def test_one_listening_port_two_api_servers_two_engines(mesh):
    pids = mesh.pids()
    assert listening_ports(pids) == {mesh.port}
    # supervisor + 2 API servers + 2 engines (+ spawn's resource tracker, if any)
    infos = {}
    for _ in range(40):
        info = server_info(mesh.base_url)
        infos[info["api_server_index"]] = info
        if len(infos) == 2:
            break
    assert set(infos) == {0, 1}
    api_pids = {i["pid"] for i in infos.values()}
    engine_pids = {e["pid"] for e in infos[0]["engines"]}
    assert len(api_pids) == 2 and len(engine_pids) == 2
    assert api_pids | engine_pids <= set(pids)


def test_every_api_server_answers_and_every_engine_serves(mesh):
    api_servers, engines = set(), set()
    for i in range(40):
        # A new connection per request: the kernel spreads connections, not requests.
        r = httpx.post(
            mesh.base_url + "/v1/completions",
            json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 2},
            headers={"Connection": "close"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        api_servers.add(r.headers["x-api-server"])
        engines.add(r.headers["x-engine-rank"])
    assert api_servers == {"0", "1"}
    assert engines == {"0", "1"}


def test_running_api_servers_have_not_imported_torch_or_engine_core(mesh):
    seen = {}
    for _ in range(40):
        info = server_info(mesh.base_url)
        seen[info["api_server_index"]] = (info["torch_imported"], info["engine_core_imported"])
    assert seen == {0: (False, False), 1: (False, False)}


def test_client_disconnect_mid_stream_aborts_the_request_in_the_engine(mesh):
    def aborted() -> int:
        return sum(e["stats"]["num_aborted"] for e in server_info(mesh.base_url)["engines"])

    before = aborted()
    with httpx.Client(base_url=mesh.base_url, timeout=30) as c:
        with c.stream(
            "POST",
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "abc",
                "max_tokens": 900,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    wait_for(lambda: aborted() > before, "the engine to report the abort", timeout=15, interval=0.2)
    # and every KV block is free again once nothing runs
    wait_for(
        lambda: all(
            e["stats"]["num_running"] == 0 and e["stats"]["kv_cache_usage"] == 0
            for e in server_info(mesh.base_url)["engines"]
        ),
        "every engine idle with its KV blocks free",
        timeout=15,
        interval=0.2,
    )


def test_headless_engine_joins_the_head_over_tcp(tiny_model):
    from zserve_proc import free_port

    model = str(tiny_model("llama"))
    rpc = free_port()
    dp = [
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc),
        "--kv-cache-memory-bytes",
        "64MiB",
    ]
    head = ZServe(model, "--served-model-name", "tiny", *dp, wait_ready=False)
    worker = ZServe(model, "--headless", "--data-parallel-start-rank", "1", *dp, wait_ready=False)
    try:
        head.start()
        time.sleep(3)
        # the head must not answer HTTP while engine 1 is missing
        with pytest.raises(httpx.HTTPError):
            httpx.get(head.base_url + "/health", timeout=1)
        worker.start()
        head.wait_until_ready()
        engines = set()
        for i in range(8):
            r = httpx.post(
                head.base_url + "/v1/completions",
                json={"model": "tiny", "prompt": f"x{i}", "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 200
            engines.add(r.headers["x-engine-rank"])
        assert engines == {"0", "1"}
        assert "tcp://127.0.0.1" in head.log() or "joining" in worker.log()
    finally:
        head.stop()
        worker.stop()


def test_sigterm_during_load_stops_every_child_and_frees_the_port(tiny_model):
    server = ZServe(
        str(tiny_model("llama")),
        "--served-model-name",
        "tiny",
        "--api-server-count",
        "2",
        "--data-parallel-size",
        "2",
        "--kv-cache-memory-bytes",
        "64MiB",
    )
    with server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        errors = []

        def load():
            try:
                for _chunk in client.completions.create(
                    model="tiny",
                    prompt="go",
                    max_tokens=1000,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    pass
            except Exception as e:  # the server going away mid-stream is expected here
                errors.append(e)

        threads = [threading.Thread(target=load) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        pids = server.pids()
        assert len(pids) >= 5
        t0 = time.monotonic()
        server.proc.send_signal(15)
        server.proc.wait(30)
        for t in threads:
            t.join(30)
        deadline = time.monotonic() + 10
        while server.pids():
            assert time.monotonic() < deadline, f"children left: {server.pids()}"
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        assert server.proc.returncode == 0
        assert port_is_free(server.port)
        assert elapsed < 15


def test_a_port_held_by_a_plain_socket_is_refused_before_any_engine_starts(tiny_model):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        server = ZServe(str(tiny_model("llama")), port=port, wait_ready=False)
        server.start()
        code = server.proc.wait(60)
        log = server.log()
        server.stop()
    finally:
        holder.close()
    assert code != 0
    assert f"port {port}" in log and "already in use" in log
    assert "said hello" not in log and "engine 0" not in log


def test_a_port_held_by_another_zserve_is_refused(mesh, tiny_model):
    second = ZServe(str(tiny_model("llama")), port=mesh.port, wait_ready=False)
    second.start()
    code = second.proc.wait(60)
    log = second.log()
    second.stop()
    assert code != 0
    assert f"port {mesh.port}" in log and "already in use" in log
    assert "said hello" not in log
    # the first server is untouched
    assert httpx.get(mesh.base_url + "/health").status_code == 200
