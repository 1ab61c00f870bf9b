"""Every CURVE socket of a multi-node server admits only the deployment's key (issue 14):
a rogue key pair that knows the deployment's *public* key is refused by the supervisor's
handshake ROUTER and by an API server's ROUTER and PULL, so it can neither stop the
server with a forged ENGINE_CORE_DEAD nor forge outputs; the real key gets in."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import zmq
from test_multinode import COMMON, MODEL, dp_flags
from zmq.utils.monitor import recv_monitor_message
from zserve_proc import ZServe, free_port, server_info

from protocol import codec
from protocol.handshake import EngineHello, encode_handshake
from protocol.keys import load_keys
from protocol.messages import (
    ENGINE_CORE_DEAD,
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineReady,
    SchedulerStats,
)
from protocol.sockets import CurveKeys, rank_identity

pytestmark = pytest.mark.timeout(180)

_RESULTS = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "admitted",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed",
}


def curve_peer(
    ctx: zmq.Context, kind: int, endpoint: str, keys: CurveKeys, server_public: bytes
) -> tuple[zmq.Socket, str]:
    """Connect as a CURVE client with `keys`; the socket and what the server's handshake said."""
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
    sock.curve_serverkey = server_public
    if kind == zmq.DEALER:
        sock.setsockopt(zmq.IDENTITY, rank_identity(0))  # engine 0's identity
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    result = "no handshake result in 30 s"
    try:
        while monitor.poll(30_000):
            event = recv_monitor_message(monitor)["event"]
            if event in _RESULTS:
                result = _RESULTS[event]
                break
    finally:
        sock.disable_monitor()
        monitor.close()
    return sock, result


def send_anyway(sock: zmq.Socket, frames: list[bytes]) -> None:
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass  # ZMQ never let this peer in: nothing to send to


def api_server_endpoints(log: str, index: int) -> tuple[str, str]:
    """(ROUTER, PULL) of one API server, from the supervisor's start-up line."""
    found = re.search(
        rf"API server {index} binds (\S+) \(requests to engines\) and (\S+) \(engine outputs\)",
        log,
    )
    assert found, log
    return found.group(1), found.group(2)


def forged_frames() -> dict[str, list[bytes]]:
    return {
        "hello": [
            encode_handshake("hello", EngineHello(PROTOCOL_VERSION, 0, False, True, 1, "forged"))
        ],
        "announcement": [
            codec.encode(EngineReady(PROTOCOL_VERSION, 0, 7, 1, 16, "x", "x", hostname="forged"))
        ],
        "engine dead": [ENGINE_CORE_DEAD, rank_identity(0)],
        "outputs": [
            codec.encode(
                EngineCoreOutputs(
                    0,
                    [EngineCoreOutput("x", [1, 2, 3])],
                    SchedulerStats(num_running=999, num_waiting=999),
                )
            )
        ],
    }


def test_a_rogue_key_pair_reaches_no_engine_link_and_the_real_one_does(tiny_model, tmp_path):
    rpc = free_port()
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}  # keys: created by the head
    model = str(tiny_model("llama"))
    flags = dp_flags("127.0.0.1", rpc)
    head = ZServe(
        model,
        "--served-model-name",
        MODEL,
        "--enable-dev-routes",  # /server_info
        *COMMON,
        *flags,
        env=env,
        wait_ready=False,
    )
    worker = ZServe(
        model,
        "--headless",
        "--data-parallel-start-rank",
        "1",
        *COMMON,
        *flags,
        env=env,
        wait_ready=False,
    )
    ctx = zmq.Context()
    try:
        head.start()
        worker.start()
        head.wait_until_ready()
        keys = load_keys(tmp_path / "config" / "zserve" / "engine-keys")
        router, pull = api_server_endpoints(head.log(), 0)
        forged = forged_frames()
        rogue = CurveKeys(*zmq.curve_keypair())  # knows the public key, not the secret
        attacks = [
            (zmq.DEALER, f"tcp://127.0.0.1:{rpc}", "hello"),
            (zmq.DEALER, router, "announcement"),
            (zmq.PUSH, pull, "engine dead"),
            (zmq.PUSH, pull, "outputs"),
        ]
        for kind, endpoint, what in attacks:
            sock, result = curve_peer(ctx, kind, endpoint, rogue, keys.public)
            assert result == "refused", (endpoint, what)
            send_anyway(sock, forged[what])
        time.sleep(3)  # longer than the supervisor takes to act on a dead engine
        assert httpx.get(head.base_url + "/health").status_code == 200
        r = httpx.post(
            head.base_url + "/v1/completions",
            json={"model": MODEL, "prompt": "still fine", "max_tokens": 3},
        )
        assert r.status_code == 200, r.text
        for engine in server_info(head.base_url)["engines"]:
            assert engine["alive"] and engine["hostname"] != "forged"
            assert engine["stats"]["num_running"] != 999
        log = head.log()
        for sign in ("is dead", "failing the server", "dropped", "undecodable"):
            assert sign not in log
        # the refusals are told, by the supervisor's ZAP handler and API server 0's
        refusals = re.findall(r"\[(\w+) pid=\d+\] zserve\.keys: refused", log)
        assert {"supervisor", "api0"} <= set(refusals)

        # Positive control: the same forged frame with the deployment's key stops the
        # server, so the checks above could fail.
        sock, result = curve_peer(ctx, zmq.PUSH, pull, keys, keys.public)
        assert result == "admitted"
        sock.send_multipart(forged["engine dead"])
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline and status != 503:
            try:
                status = httpx.get(head.base_url + "/health").status_code
            except httpx.HTTPError:
                pass  # the supervisor stopped the server already
            time.sleep(0.05)
        assert status == 503
        assert "engine 0 is dead: the engine reported a fatal error" in head.log()
    finally:
        ctx.destroy(linger=0)
        head.stop()
        worker.stop()
