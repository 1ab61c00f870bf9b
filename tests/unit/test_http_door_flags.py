"""The HTTP door's flags before anything starts (launcher/http_door.py): each refusal with
its reason, the Unix socket's claim and release, the ready line's address, and the
access-log filter. The servers themselves are in tests/e2e/test_http_door.py."""

from __future__ import annotations

import logging
import os
import socket
import threading

import pytest

from frontend.config import FrontendConfig
from frontend.server import SkipPaths
from launcher.cli import build_parser
from launcher.http_door import (
    MAX_UDS_PATH_BYTES,
    apply_http_door,
    claim_unix_socket,
    http_door_refusal,
    listen_address,
)
from launcher.port import PortBusyError

pytestmark = pytest.mark.timeout(60)


def _args(*flags: str):
    return build_parser().parse_args(["serve", "m", *flags])


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--ssl-keyfile", "k"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-ca-certs", "ca"], "--ssl-ca-certs needs --ssl-certfile"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh needs --ssl-certfile"),
        (["--ssl-certfile", "c", "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
        (["--grpc", "--uds", "/tmp/x.sock"], "--uds is for the HTTP door"),
        (["--grpc", "--ssl-certfile", "c", "--ssl-ciphers", "HIGH"], "--ssl-ciphers is for"),
        (
            ["--grpc", "--ssl-certfile", "c", "--ssl-ca-certs", "a", "--ssl-cert-reqs", "1"],
            "the gRPC door either requires client certificates (2)",
        ),
        (["--uds", "/tmp/" + "s" * MAX_UDS_PATH_BYTES], "holds 1 to 107 bytes, this one 112"),
        (["--ssl-certfile", "/nonexistent.pem"], "--ssl-certfile/--ssl-keyfile: cannot be used"),
        (["--collect-detailed-traces", "all"], "--collect-detailed-traces is not supported"),
    ],
)
def test_each_refusal_names_the_flag_and_why(flags, reason):
    problem = http_door_refusal(_args(*flags))
    assert problem is not None and reason in problem, problem


def test_the_tracing_protocol_comes_from_otels_variable(monkeypatch):
    from frontend.tracing import RequestTracer

    args = _args("--otlp-traces-endpoint", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    assert "'http/json' is not supported" in http_door_refusal(args)
    for protocol, module in [("grpc", "grpc"), ("http/protobuf", "http")]:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
        assert http_door_refusal(args) is None
        tracer = RequestTracer("http://127.0.0.1:4317", "m", 0)
        assert f"otlp.proto.{module}." in type(tracer.exporter).__module__
        tracer.close()  # nothing waiting: at once


def test_an_unknown_cert_reqs_value_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        _args("--ssl-cert-reqs", "3")
    assert "invalid choice: 3" in capsys.readouterr().err


def test_the_flags_reach_the_api_servers_config():
    frontend = FrontendConfig(model_dir="m", tokenizer_dir="m", served_model_names=["m"])
    args = _args(
        "--uds", "/tmp/z.sock", "--disable-access-log-for-endpoints", " /metrics,/health,,",
        "--h11-max-header-count", "12", "--h11-max-incomplete-event-size", "4KiB",
    )  # fmt: skip
    apply_http_door(frontend, args)
    assert frontend.uds == "/tmp/z.sock"
    assert frontend.access_log and frontend.access_log_skip == ["/health", "/metrics"]
    assert (args.max_header_count, args.max_header_bytes) == (12, 4096)
    apply_http_door(frontend, _args("--disable-uvicorn-access-log"))
    assert not frontend.access_log


def test_the_ready_line_gives_vllms_address_forms():
    def address(**kw) -> str:
        base = dict(model_dir="m", tokenizer_dir="m", served_model_names=["m"])
        return listen_address(FrontendConfig(**base, **kw))

    assert address(host="127.0.0.1", port=8000) == "http://127.0.0.1:8000"
    assert address(host=None, port=1, ssl_certfile="c") == "https://0.0.0.0:1"
    assert address(host="[::1]", port=2, grpc=True) == "grpc://[::1]:2"
    assert address(uds="/run/z.sock") == "unix:/run/z.sock"


def test_a_unix_socket_is_claimed_released_and_never_taken_from_another(tmp_path):
    path = str(tmp_path / "z.sock")
    listener = claim_unix_socket(path)
    with pytest.raises(PortBusyError, match="another server listens on it"):
        claim_unix_socket(path)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)  # the listener accepts connections at once (its backlog)
    client.close()
    listener.release()
    assert not os.path.exists(path)

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a killed server's file: nobody listens
    listener = claim_unix_socket(path)
    # A later server took the path meanwhile: its file is not ours to remove.
    os.unlink(path)
    other = claim_unix_socket(path)
    listener.release()
    assert os.path.exists(path)
    other.release()

    (tmp_path / "file").write_text("data")
    with pytest.raises(PortBusyError, match="exists and is not a socket"):
        claim_unix_socket(str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "data"


def test_a_socket_whose_backlog_is_full_still_counts_as_taken(tmp_path):
    """A busy server's socket refuses a connect with EAGAIN, not ECONNREFUSED."""
    path = str(tmp_path / "busy.sock")
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(path)
    busy.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)
    done = threading.Event()
    outcome: list[Exception] = []

    def claim() -> None:
        try:
            claim_unix_socket(path)
        except PortBusyError as e:
            outcome.append(e)
        done.set()

    threading.Thread(target=claim, daemon=True).start()
    assert done.wait(10)
    assert outcome and "another server listens on it" in str(outcome[0])
    for s in [*fillers, busy]:
        s.close()


def test_the_access_filter_drops_the_paths_and_their_queries_only():
    keep = SkipPaths(["/health", "/metrics"])

    def record(path: str) -> logging.LogRecord:
        args = ("1.2.3.4:5", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", 20, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    assert not keep.filter(record("/health"))
    assert not keep.filter(record("/metrics?x=1"))
    assert keep.filter(record("/healthz"))
    assert keep.filter(record("/v1/models"))
