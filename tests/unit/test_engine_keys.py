"""protocol/keys.py: ZAP that admits only the deployment's key, and fails closed
without a handler (issue 14)."""

from __future__ import annotations

import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.keys import create_keys, start_authenticator
from protocol.sockets import CurveKeys, bind, make_socket, tcp_address

pytestmark = pytest.mark.timeout(60)


_RESULTS = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "admitted",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed",
}


def handshake_result(ctx: zmq.Context, endpoint: str, client: CurveKeys, server_public: bytes):
    """Connect a CURVE PUSH with `client`'s pair; what the server's handshake said."""
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    sock.curve_publickey, sock.curve_secretkey = client.public, client.secret
    sock.curve_serverkey = server_public
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    try:
        while monitor.poll(20_000):
            event = recv_monitor_message(monitor)["event"]
            if event in _RESULTS:
                return _RESULTS[event]
        return "no handshake result"
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


@pytest.fixture
def deployment(tmp_path) -> CurveKeys:
    return create_keys(tmp_path)


def test_zap_admits_the_deployment_key_and_refuses_any_other(deployment):
    ctx = zmq.Context()
    auth = start_authenticator(ctx, deployment)
    server = make_socket(ctx, zmq.PULL, curve=deployment, curve_server=True)
    try:
        endpoint = bind(server, tcp_address("127.0.0.1", 0))
        rogue = CurveKeys(*zmq.curve_keypair())
        assert handshake_result(ctx, endpoint, rogue, deployment.public) == "refused"
        assert handshake_result(ctx, endpoint, deployment, deployment.public) == "admitted"
    finally:
        server.close()
        auth.stop()
        ctx.term()


def test_a_curve_server_without_a_zap_handler_refuses_everyone(deployment):
    """Fail closed: a handler not started (or stopped early) must not mean 'admit all'."""
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.PULL, curve=deployment, curve_server=True)
    try:
        endpoint = bind(server, tcp_address("127.0.0.1", 0))
        rogue = CurveKeys(*zmq.curve_keypair())
        assert handshake_result(ctx, endpoint, rogue, deployment.public) != "admitted"
        assert handshake_result(ctx, endpoint, deployment, deployment.public) != "admitted"
        assert not server.poll(100)
    finally:
        server.close()
        ctx.term()


def test_refusals_are_logged_at_most_once_a_minute(deployment, caplog):
    ctx = zmq.Context()
    auth = start_authenticator(ctx, deployment)
    server = make_socket(ctx, zmq.PULL, curve=deployment, curve_server=True)
    try:
        endpoint = bind(server, tcp_address("127.0.0.1", 0))
        for _ in range(3):
            rogue = CurveKeys(*zmq.curve_keypair())
            assert handshake_result(ctx, endpoint, rogue, deployment.public) == "refused"
        time.sleep(0.1)
    finally:
        server.close()
        auth.stop()
        ctx.term()
    lines = [r.getMessage() for r in caplog.records if r.name == "zserve.keys"]
    assert len(lines) == 1 and "unknown CURVE key" in lines[0]
