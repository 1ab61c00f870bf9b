"""The HTTP door's vLLM flags on real servers (launcher/http_door.py):

- one server over TLS that requires client certificates from its CA (--ssl-ca-certs,
  --ssl-cert-reqs 2), reloads rotated certificates (--enable-ssl-refresh), keeps /health
  out of its access log (--disable-access-log-for-endpoints) and takes vLLM's name for
  the header limit (--h11-max-header-count);
- one with two API servers on a Unix socket (--uds) that replaces a stale socket file,
  refuses a second server on a live one, survives an API server's restart and removes
  its file when it stops; its access log is off (--disable-uvicorn-access-log).
"""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path

import httpx
import openai
import pytest
from e2e_http import MODEL, SERVED_NAMES, assert_error, parse_sse
from e2e_tls import CertificateAuthority, TLSServer, client_context, have_openssl
from zserve_proc import ZServe, wait_for

pytestmark = pytest.mark.timeout(120)

OPEN_FILES = 256  # the --uds server's: its API servers hold ~150 connections each
ACCESS_LINE = re.compile(r'uvicorn\.access: .* - "(\w+) (\S+) HTTP/1\.1" (\d+)')


def access_lines(server: ZServe) -> list[tuple[str, str, str]]:
    return ACCESS_LINE.findall(server.log())


def rss_bytes(server: ZServe) -> int:
    total = 0
    for pid in server.pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found = re.search(r"VmRSS:\s+(\d+)", status)
        total += int(found.group(1)) * 1024 if found else 0
    return total


# --- TLS with client certificates ------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if not have_openssl():
        pytest.skip("no openssl to make certificates")
    folder = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(folder / "ca")
    served = folder / "served"  # the files the server reads, replaced to rotate them
    served.mkdir()
    key, cert = ca.issue("first", server=True)
    os.replace(key, served / "server.key")
    os.replace(cert, served / "server.pem")
    return {
        "ca": ca,
        "served": served,
        "client": ca.issue("a-client", server=False),
        "stranger": CertificateAuthority(folder / "other", "other").issue("x", server=False),
    }


@pytest.fixture(scope="module")
def tls_server(tiny_model, pki):
    served = pki["served"]
    with TLSServer(
        str(tiny_model("llama")),
        *SERVED_NAMES,
        "--device", "cpu",
        "--ssl-keyfile", str(served / "server.key"),
        "--ssl-certfile", str(served / "server.pem"),
        "--ssl-ca-certs", str(pki["ca"].cert),
        "--ssl-cert-reqs", "2",
        "--enable-ssl-refresh",
        "--disable-access-log-for-endpoints", "/health,/metrics",
        "--h11-max-header-count", "30",
        context=client_context(pki["ca"].cert, pki["client"]),
    ) as s:  # fmt: skip
        yield s


def served_name(server: TLSServer, pki) -> str:
    """The CN of the certificate a new connection is shown."""
    context = client_context(pki["ca"].cert, pki["client"])
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            subject = dict(pair[0] for pair in tls.getpeercert()["subject"])
    return subject["commonName"]


def test_a_client_with_a_certificate_from_the_ca_is_served(tls_server, pki):
    http = httpx.Client(verify=tls_server.context, timeout=60)
    client = openai.OpenAI(
        base_url=tls_server.base_url + "/v1", api_key="none", http_client=http, max_retries=0
    )
    done = client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert done.usage.completion_tokens == 4
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("who", ["nobody", "stranger"])
def test_a_client_without_a_certificate_from_the_ca_is_refused(tls_server, pki, who):
    cert = None if who == "nobody" else pki["stranger"]
    context = client_context(pki["ca"].cert, cert)
    with pytest.raises(httpx.TransportError):
        httpx.get(tls_server.base_url + "/health", verify=context, timeout=10)
    assert httpx.get(tls_server.base_url + "/health", verify=tls_server.context).status_code == 200


def test_handshake_floods_and_garbage_leave_health_answering_and_memory_flat(tls_server, pki):
    """Malformed input at the TLS layer: plain HTTP, random bytes, a handshake without a
    certificate, each many times; /health answers after, and the server's memory did not
    grow by more than a few MB."""
    ok = httpx.Client(base_url=tls_server.base_url, verify=tls_server.context, timeout=30)
    assert ok.get("/health").status_code == 200
    before = rss_bytes(tls_server)
    junk = [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(4096), b"\x16\x03\x01" * 2000]
    for i in range(150):
        with socket.create_connection(("127.0.0.1", tls_server.port), timeout=10) as raw:
            raw.sendall(junk[i % len(junk)])
            raw.settimeout(5)
            try:
                raw.recv(1024)
            except OSError:
                pass
    bare = client_context(pki["ca"].cert)
    for _ in range(50):
        with pytest.raises(httpx.TransportError):
            httpx.get(tls_server.base_url + "/health", verify=bare, timeout=10)
    assert ok.get("/health").status_code == 200
    assert rss_bytes(tls_server) - before < 30 * 1000 * 1000


def test_vllms_header_count_flag_is_the_header_limit(tls_server):
    http = httpx.Client(base_url=tls_server.base_url, verify=tls_server.context, timeout=30)
    many = {f"x-h{i}": "v" for i in range(40)}
    assert_error(http.get("/v1/models", headers=many), 431, contains=["--max-header-count"])
    assert http.get("/v1/models", headers={"x-one": "v"}).status_code == 200


def test_the_access_log_skips_the_paths_asked_for(tls_server):
    http = httpx.Client(base_url=tls_server.base_url, verify=tls_server.context, timeout=30)
    for path in ("/health", "/health?probe=1", "/metrics", "/v1/models", "/nowhere"):
        http.get(path)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert http.post("/v1/completions", json=body).status_code == 200

    def logged() -> bool:
        return ("POST", "/v1/completions", "200") in access_lines(tls_server)

    wait_for(logged, timeout=10, what="the completion's access line")
    lines = access_lines(tls_server)
    assert ("GET", "/v1/models", "200") in lines
    assert ("GET", "/nowhere", "404") in lines
    assert not [line for line in lines if line[1].startswith(("/health", "/metrics"))]


def test_a_rotated_certificate_is_shown_to_new_connections(tls_server, pki):
    """Runs last of the TLS tests (file order). A certificate without its key is refused
    and the loaded pair stays; once the key follows, new connections see the new one."""
    served = pki["served"]
    assert served_name(tls_server, pki) == "first"
    key, cert = pki["ca"].issue("second", server=True)
    os.replace(cert, served / "server.pem")  # the key still the first's: a mismatch
    wait_for(lambda: "cannot be used" in tls_server.log(), timeout=10, what="the refused reload")
    assert served_name(tls_server, pki) == "first"
    os.replace(key, served / "server.key")
    wait_for(lambda: served_name(tls_server, pki) == "second", timeout=10, what="the reload")
    assert "TLS files reloaded" in tls_server.log()
    http = httpx.Client(base_url=tls_server.base_url, verify=tls_server.context, timeout=30)
    assert http.get("/health").status_code == 200


# --- a Unix socket ---------------------------------------------------------------------------


class UnixSocketServer(ZServe):
    """ZServe on --uds PATH; its clients reach it through that file."""

    def __init__(self, *args, uds: Path, **kwargs) -> None:
        super().__init__(*args, "--uds", str(uds), **kwargs)
        self.uds = uds

    @property
    def base_url(self) -> str:
        return "http://zserve"  # the host is not used: the transport dials the socket

    def http(self, **kwargs) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.uds))
        return httpx.Client(base_url=self.base_url, transport=transport, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def uds_path(tmp_path_factory) -> Path:
    """A path short enough for sockaddr_un, holding a stale socket: bound, then closed."""
    path = tmp_path_factory.mktemp("uds") / "zs.sock"
    if len(os.fsencode(path)) > 100:
        path = Path(f"/tmp/zserve-test-{os.getpid()}.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    return path


@pytest.fixture(scope="module")
def uds_server(tiny_model, uds_path):
    with UnixSocketServer(
        str(tiny_model("llama")),
        *SERVED_NAMES,
        "--device", "cpu",
        "--api-server-count", "2",
        "--disable-uvicorn-access-log",
        uds=uds_path,
        open_files=OPEN_FILES,
    ) as s:  # fmt: skip
        yield s


def test_the_openai_client_is_served_over_the_unix_socket(uds_server):
    with uds_server.http() as http:
        client = openai.OpenAI(
            base_url="http://zserve/v1", api_key="none", http_client=http, max_retries=0
        )
        done = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3)
        assert [c.finish_reason for c in done.choices] == ["length", "length"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 3}) as r:
            assert r.status_code == 200
            sse = parse_sse(r.read().decode())
        assert sse.done and sse.events[-1]["choices"][0]["finish_reason"] == "length"


def test_the_stale_socket_file_was_replaced_and_the_ready_line_names_the_socket(
    uds_server, uds_path
):
    log = uds_server.log()
    assert f"--uds {uds_path}: removed a socket file nobody listened on" in log
    assert f"zserve ready on unix:{uds_path} (2 API server(s)" in log
    assert log.count(f"serving HTTP on unix socket {uds_path}") == 2
    assert not access_lines(uds_server)  # --disable-uvicorn-access-log


def test_a_second_server_on_a_live_socket_is_refused(uds_server, uds_path, tiny_model):
    second = ZServe(str(tiny_model("llama")), "--uds", str(uds_path), wait_ready=False)
    with second:
        assert second.proc.wait(60) == 1
        assert "another server listens on it" in second.log()
    with uds_server.http() as http:
        assert http.get("/health").status_code == 200


def test_at_the_open_files_limit_connections_wait_instead_of_being_reset(uds_server):
    """Past what RLIMIT_NOFILE leaves room for, an API server stops accepting (libuv
    would accept and close each connection: a reset). More connections than both API
    servers can hold all stay open, waiting in the listen backlog; once they close, both
    accept again and /health answers."""
    held = []
    try:
        for _ in range(2 * OPEN_FILES):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(uds_server.uds))  # the kernel queues what is not accepted
            held.append(conn)
        wait_for(
            lambda: uds_server.log().count("new connections wait in the listen backlog") >= 2,
            timeout=20,
            what="both API servers to stop accepting",
        )
        assert "RLIMIT_NOFILE 256" in uds_server.log()
        for conn in held:  # none was closed or reset by the server
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.recv(1)
    finally:
        for conn in held:
            conn.close()
    wait_for(
        lambda: uds_server.log().count("accepting connections again") >= 2,
        timeout=20,
        what="both API servers to accept again",
    )
    with uds_server.http() as http:
        assert http.get("/health").status_code == 200
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200


def test_a_restarted_api_server_accepts_on_the_same_socket(uds_server):
    with uds_server.http() as http:
        pid = int(re.findall(r"\[api0 pid=(\d+)\]", uds_server.log())[0])
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: uds_server.log().count("serving HTTP on unix socket") == 3,
            timeout=60,
            what="API server 0's restart",
        )
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        for _ in range(20):  # both API servers take connections from the one socket
            with uds_server.http() as fresh:
                assert fresh.post("/v1/completions", json=body).status_code == 200
        assert http.get("/health").status_code == 200


def test_the_socket_file_is_removed_when_the_server_stops(uds_server, uds_path):
    """Runs last (file order): stops the module's server."""
    assert uds_path.exists()
    assert uds_server.stop() == 0
    assert not uds_path.exists()
