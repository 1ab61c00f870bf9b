"""protocol/keys.py and `zserve make-engine-keys`: private key files, ZAP that admits only
the deployment's key, and fails closed without a handler (issue 14)."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from launcher.cli import main
from protocol.keys import (
    EngineKeysError,
    create_keys,
    engine_keys,
    load_keys,
    public_file,
    secret_file,
    start_authenticator,
)
from protocol.sockets import CurveKeys, bind, make_socket, tcp_address

pytestmark = pytest.mark.timeout(60)


def test_created_keys_are_private_and_load_back(tmp_path):
    folder = tmp_path / "keys"
    keys = create_keys(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for f in (secret_file(folder), public_file(folder)):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert zmq.curve_public(keys.secret) == keys.public
    assert load_keys(folder) == keys
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temp left


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o644])
def test_a_secret_key_others_can_read_or_write_is_refused_with_the_fix(tmp_path, mode):
    create_keys(tmp_path)
    path = secret_file(tmp_path)
    os.chmod(path, mode)
    with pytest.raises(EngineKeysError) as e:
        load_keys(tmp_path)
    assert str(path) in str(e.value) and f"chmod 600 {path}" in str(e.value)
    with pytest.raises(EngineKeysError):  # the head does not silently accept them either
        engine_keys(tmp_path, create=True)
    os.chmod(path, 0o600)
    assert load_keys(tmp_path).public == zmq.auth.load_certificate(public_file(tmp_path))[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_secret_key_owned_by_another_user_is_refused(tmp_path):
    create_keys(tmp_path)
    path = secret_file(tmp_path)
    os.chown(path, 54321, -1)
    with pytest.raises(EngineKeysError, match="owned by uid 54321") as e:
        load_keys(tmp_path)
    assert str(path) in str(e.value) and "chown" in str(e.value)


def test_a_worker_waits_for_keys_to_appear(tmp_path):
    folder = tmp_path / "keys"
    writer = threading.Timer(1.0, create_keys, args=(folder,))
    writer.start()
    try:
        keys = engine_keys(folder, create=False, wait_s=30)
    finally:
        writer.join()
    assert keys == load_keys(folder)
    with pytest.raises(EngineKeysError, match="no engine keys in"):
        engine_keys(tmp_path / "never", create=False, wait_s=0.6)


def test_create_keeps_an_existing_pair_unless_told_to_overwrite(tmp_path):
    first = create_keys(tmp_path)
    assert create_keys(tmp_path) == first  # a racing head loses cleanly
    replaced = create_keys(tmp_path, overwrite=True)
    assert replaced != first and load_keys(tmp_path) == replaced


def test_make_engine_keys_creates_then_refuses_to_overwrite_without_force(tmp_path, capsys):
    folder = tmp_path / "deploy"
    assert main(["make-engine-keys", str(folder)]) == 0
    keys = load_keys(folder)
    assert keys.public.decode() in capsys.readouterr().out
    assert stat.S_IMODE(secret_file(folder).stat().st_mode) == 0o600
    assert main(["make-engine-keys", str(folder)]) == 1
    err = capsys.readouterr().err
    assert str(secret_file(folder)) in err and "--force" in err
    assert load_keys(folder) == keys
    assert main(["make-engine-keys", str(folder), "--force"]) == 0
    assert load_keys(folder) != keys


# --- ZAP ----------------------------------------------------------------------------

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
