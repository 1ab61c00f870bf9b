"""Headless engines on other hosts (network namespaces), IPv6, start-up order, and
secure engine links: rogue peers can neither inject nor read (issue 5, items 3, 4)."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import time

import httpx
import pytest
import zmq
import zmq.auth
from zserve_proc import ZServe, free_port, listening_ports, server_info

from protocol import codec
from protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    SamplingParams,
    SchedulerStats,
)

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"
COMMON = ("--kv-cache-memory-bytes", "32MiB", "--disable-log-requests")


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"zsprobe{secrets.token_hex(3)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@pytest.fixture
def worker_host():
    """A second "host": a network namespace joined to this one by a veth pair, with
    IPv4 10.213.x.0/24 and IPv6 fd00:213:x::/64 addresses on both ends."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(2)
    ns, here, there = f"zsw{tag}", f"zsh{tag}", f"zsp{tag}"
    x = int(tag, 16) % 250 + 1
    v4 = (f"10.213.{x}.1", f"10.213.{x}.2")
    v6 = (f"fd00:213:{x:x}::1", f"fd00:213:{x:x}::2")
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _sh("ip", "link", "set", there, "netns", ns)
        _sh("ip", "addr", "add", f"{v4[0]}/24", "dev", here)
        _sh("ip", "-6", "addr", "add", f"{v6[0]}/64", "dev", here, "nodad")
        _sh("ip", "link", "set", here, "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{v4[1]}/24", "dev", there)
        _sh(
            "ip",
            "netns",
            "exec",
            ns,
            "ip",
            "-6",
            "addr",
            "add",
            f"{v6[1]}/64",
            "dev",
            there,
            "nodad",
        )
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", there, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield {"ns": ns, "v4": v4, "v6": v6}
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def dp_flags(address: str, rpc: int) -> list[str]:
    return [
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        address,
        "--data-parallel-rpc-port",
        str(rpc),
    ]


@pytest.mark.parametrize("family", ["v4", "v6"])
def test_headless_engine_in_another_network_namespace_serves(
    worker_host, tiny_model, tmp_path, family
):
    head_addr, _ = worker_host[family]
    rpc = free_port()
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}  # keys: created by the head
    model = str(tiny_model("llama"))
    head = ZServe(
        model,
        "--served-model-name",
        MODEL,
        *COMMON,
        *dp_flags(head_addr, rpc),
        env=env,
        wait_ready=False,
    )
    worker = ZServe(
        model,
        "--headless",
        "--data-parallel-start-rank",
        "1",
        *COMMON,
        *dp_flags(head_addr, rpc),
        env=env,
        wait_ready=False,
    )
    worker.args = ["ip", "netns", "exec", worker_host["ns"], *worker.args]
    try:
        head.start()
        worker.start()
        head.wait_until_ready()
        engines = set()
        for i in range(10):
            r = httpx.post(
                head.base_url + "/v1/completions",
                json={"model": MODEL, "prompt": f"n{i}", "max_tokens": 3},
            )
            assert r.status_code == 200, r.text
            engines.add(r.headers["x-engine-rank"])
        assert engines == {"0", "1"}
        # engine 1 really talks across the veth: its TCP links end at the head's address
        ss = subprocess.run(
            ["ip", "netns", "exec", worker_host["ns"], "ss", "-tn"], capture_output=True, text=True
        ).stdout
        assert head_addr in ss
        assert os.path.isfile(
            tmp_path / "config" / "zserve" / "engine-keys" / "zserve-engine.key_secret"
        )
    finally:
        head.stop()
        worker.stop()


def _rogue_attacks(ctx: zmq.Context, endpoints: list[str], server_public: bytes) -> None:
    """Plain peers and CURVE peers with their own keys send garbage, a forged ADD and
    forged outputs to every TCP endpoint of the server."""
    forged_add = codec.encode_request(
        RequestType.ADD,
        EngineCoreRequest("forged", list(range(50)), SamplingParams(max_tokens=500), 0.0),
    )
    forged_outputs = codec.encode(
        EngineCoreOutputs(
            0, [EngineCoreOutput("x", [1, 2, 3])], SchedulerStats(num_running=999, num_waiting=999)
        )
    )
    payloads = [[b"\xc1garbage"], forged_add, [forged_outputs], [b"\x00" * 70000]]
    sockets = []
    for endpoint in endpoints:
        for kind in (zmq.DEALER, zmq.PUSH):
            for curve in (False, True):
                s = ctx.socket(kind)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.IPV6, 1)  # without it, tcp://[::1] never connects
                s.setsockopt(zmq.SNDTIMEO, 200)
                if curve:
                    public, secret = zmq.curve_keypair()
                    s.curve_publickey, s.curve_secretkey = public, secret
                    s.curve_serverkey = server_public
                if kind == zmq.DEALER:
                    s.setsockopt(zmq.IDENTITY, b"\x00\x00")  # engine 0's identity
                s.connect(endpoint)
                sockets.append(s)
    time.sleep(0.5)
    for s in sockets:
        for frames in payloads:
            try:
                s.send_multipart(frames)
            except zmq.Again:
                pass  # ZMQ never let this peer in: nothing to send to
    time.sleep(1.0)
    for s in sockets:
        s.close()


def test_an_engine_started_before_its_head_waits_and_rogue_peers_get_nothing(tiny_model, tmp_path):
    rpc = free_port()
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    model = str(tiny_model("llama"))
    worker = ZServe(
        model,
        "--headless",
        "--data-parallel-start-rank",
        "1",
        *COMMON,
        *dp_flags("::1", rpc),
        env=env,
        wait_ready=False,
    )
    head = ZServe(
        model,
        "--served-model-name",
        MODEL,
        "--enable-dev-routes",  # /server_info
        *COMMON,
        *dp_flags("::1", rpc),
        env=env,
        wait_ready=False,
    )
    ctx = zmq.Context()
    try:
        worker.start()  # before the head, and before any key exists
        time.sleep(4)
        assert worker.proc.poll() is None
        head.start()
        head.wait_until_ready()
        before = server_info(head.base_url)["engines"]
        endpoints = [f"tcp://[::1]:{p}" for p in listening_ports(head.pids()) if p != head.port]
        assert f"tcp://[::1]:{rpc}" in endpoints and len(endpoints) >= 3  # handshake, ROUTER, PULL
        keys = glob.glob(str(tmp_path / "config" / "zserve" / "engine-keys" / "*.key"))
        public = zmq.auth.load_certificate(keys[0])[0]
        _rogue_attacks(ctx, endpoints, public)
        r = httpx.post(
            head.base_url + "/v1/completions",
            json={"model": MODEL, "prompt": "still fine", "max_tokens": 3},
        )
        assert r.status_code == 200
        after = server_info(head.base_url)["engines"]
        for b, a in zip(before, after, strict=True):
            assert a["alive"]
            assert a["stats"]["num_waiting"] != 999 and a["stats"]["num_running"] != 999
            # only our own 3-token request ran: the forged 50-token ADD never arrived
            assert a["stats"]["prompt_tokens_computed"] - b["stats"]["prompt_tokens_computed"] < 50
        log = head.log() + worker.log()
        assert "undecodable" not in log  # CURVE stopped every rogue byte before zserve
    finally:
        ctx.destroy(linger=0)
        head.stop()
        worker.stop()


def test_garbage_on_local_ipc_sockets_is_logged_and_dropped(tiny_model):
    with ZServe(str(tiny_model("llama")), "--served-model-name", MODEL, *COMMON) as server:
        runtime = glob.glob(f"/tmp/zserve-{server.proc.pid}-*")[0]
        ctx = zmq.Context()
        try:
            push = ctx.socket(zmq.PUSH)
            push.connect(f"ipc://{runtime}/api0-out")
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, b"\x07\x00")
            dealer.connect(f"ipc://{runtime}/api0-in")
            for frames in (
                [b"\xc1garbage"],
                [b"\x01", b"\x02", b"\x03"],
                [codec.encode(EngineCoreOutputs(5))],
            ):
                push.send_multipart(frames)
                dealer.send_multipart(frames)
            time.sleep(1.0)
            push.close(linger=0)
            dealer.close(linger=0)
        finally:
            ctx.destroy(linger=0)
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": MODEL, "prompt": "ok", "max_tokens": 2},
        )
        assert r.status_code == 200
        assert httpx.get(server.base_url + "/health").status_code == 200
        log = server.log()
        assert "dropped an undecodable output message" in log
        assert "dropped" in log and "request socket" in log or "unknown engine" in log
