"""The HTTP door's vLLM flags: TLS with client certificates and certificate refresh, a
Unix socket instead of the TCP port (--uds), and the access log; and the checks of the
tracing flags (launcher/serve_feature_args.py, frontend/tracing.py).

The supervisor reads the certificate files once before anything starts, so a bad file is
one clear error rather than N API servers failing one by one. It also binds --uds
itself: a Unix socket has no SO_REUSEPORT group, so the API servers share the one
listener the supervisor hands them (frontend/server.py), where on TCP each binds its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from frontend.tracing import tracing_problem
from launcher.port import PortBusyError

if TYPE_CHECKING:
    from frontend.config import FrontendConfig

log = logging.getLogger("zserve.supervisor")

# sockaddr_un's sun_path holds 108 bytes, the terminating NUL included.
MAX_UDS_PATH_BYTES = 107
CERT_REQS = {0: "none", 1: "optional", 2: "required"}  # ssl.CERT_NONE, _OPTIONAL, _REQUIRED


def add_http_door_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "TLS, Unix socket and access log",
        "vLLM's flags with vLLM's meanings (launcher/http_door.py)",
    )
    g.add_argument("--ssl-keyfile", default=None, help="the server's private key (PEM)")
    g.add_argument(
        "--ssl-certfile", default=None, help="the server's certificate chain (PEM): serve HTTPS"
    )
    g.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="CA certificates (PEM) that client certificates are checked against",
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=sorted(CERT_REQS),
        default=0,
        help="client certificates: 0 not asked for, 1 checked when sent, 2 required (the "
        "values of Python's ssl.CERT_*); 1 and 2 need --ssl-ca-certs",
    )
    g.add_argument(
        "--ssl-ciphers",
        default=None,
        help="OpenSSL cipher list for TLS 1.2 and below (TLS 1.3 suites are OpenSSL's)",
    )
    g.add_argument(
        "--enable-ssl-refresh",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reload the key, certificate and CA files when they change on disk; new "
        "connections get the new ones, open ones keep theirs",
    )
    g.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="serve HTTP on this Unix socket instead of --host/--port (a stale socket file "
        "is replaced; the file's mode follows the umask)",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="write no access log line ('client - \"METHOD path HTTP/1.1\" status')",
    )
    g.add_argument(
        "--disable-access-log-for-endpoints",
        default=None,
        metavar="PATHS",
        help="comma-separated paths whose requests get no access log line, e.g. "
        "/health,/metrics (matched exactly, without the query)",
    )


def http_door_refusal(args: argparse.Namespace) -> str | None:
    """Why these flags cannot start zserve as asked; None: they can."""
    tls_only = [
        flag
        for flag, value in (
            ("--ssl-keyfile", args.ssl_keyfile),
            ("--ssl-ca-certs", args.ssl_ca_certs),
            ("--ssl-cert-reqs", args.ssl_cert_reqs),
            ("--ssl-ciphers", args.ssl_ciphers),
            ("--enable-ssl-refresh", args.enable_ssl_refresh),
        )
        if value
    ]
    if tls_only and not args.ssl_certfile:
        return f"{tls_only[0]} needs --ssl-certfile: it configures TLS, which that turns on"
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        return (
            f"--ssl-cert-reqs {args.ssl_cert_reqs} checks client certificates, which needs "
            f"--ssl-ca-certs (the CA certificates that sign them)"
        )
    if args.grpc:
        for flag, value in (
            ("--uds", args.uds),
            ("--ssl-ciphers", args.ssl_ciphers),
            ("--enable-ssl-refresh", args.enable_ssl_refresh),
        ):
            if value:
                return f"{flag} is for the HTTP door; the gRPC door (--grpc) does not take it"
        if args.ssl_cert_reqs == 1:
            return (
                "--ssl-cert-reqs 1 is for the HTTP door: the gRPC door either requires client "
                "certificates (2) or does not ask for them (0)"
            )
    if args.uds is not None:
        size = len(os.fsencode(args.uds))
        if not 0 < size <= MAX_UDS_PATH_BYTES:
            return (
                f"--uds: a Unix socket path holds 1 to {MAX_UDS_PATH_BYTES} bytes, this one {size}"
            )
    if args.collect_detailed_traces:
        return (
            "--collect-detailed-traces is not supported: zserve's spans carry each "
            "request's queue, prefill, decode and end-to-end times, not per-step model timings"
        )
    problem = tracing_problem(args.otlp_traces_endpoint)
    if problem:
        return problem
    return _tls_files_problem(args) if args.ssl_certfile else None


def _tls_files_problem(args: argparse.Namespace) -> str | None:
    """Load the files as the API servers will, to fail here with the reason."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    step = "--ssl-certfile/--ssl-keyfile"
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs:
            step = "--ssl-ca-certs"
            context.load_verify_locations(args.ssl_ca_certs)
        if args.ssl_ciphers:
            step = "--ssl-ciphers"
            context.set_ciphers(args.ssl_ciphers)
    except (OSError, ssl.SSLError) as e:
        return f"{step}: cannot be used for TLS: {e}"
    return None


def apply_http_door(frontend: FrontendConfig, args: argparse.Namespace) -> None:
    frontend.ssl_keyfile = args.ssl_keyfile
    frontend.ssl_certfile = args.ssl_certfile
    frontend.ssl_ca_certs = args.ssl_ca_certs
    frontend.ssl_cert_reqs = args.ssl_cert_reqs
    frontend.ssl_ciphers = args.ssl_ciphers
    frontend.ssl_refresh = args.enable_ssl_refresh
    frontend.uds = args.uds
    frontend.otlp_traces_endpoint = args.otlp_traces_endpoint
    frontend.access_log = not args.disable_uvicorn_access_log
    frontend.access_log_skip = sorted(
        {p.strip() for p in (args.disable_access_log_for_endpoints or "").split(",") if p.strip()}
    )


@dataclass
class UnixListener:
    """--uds: the listening socket the API servers share, and its file."""

    sock: socket.socket
    path: str
    inode: int  # the file's, to tell it from a later server's socket at the same path

    def release(self) -> None:
        """Close the listener and remove its file, unless another server's socket has
        taken the path since."""
        self.sock.close()
        try:
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def claim_unix_socket(path: str, backlog: int = 4096) -> UnixListener:
    """The listening socket at `path`, bound here for the API servers to share.

    A socket file that nobody listens on (a killed server's) is replaced; one that
    answers, or a file that is not a socket, stops the start.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise PortBusyError(
                f"--uds {path} exists and is not a socket; zserve will not replace it"
            )
        if _answers(path):
            raise PortBusyError(
                f"--uds {path}: another server listens on it; choose another path or stop it"
            )
        os.unlink(path)
        log.info("--uds %s: removed a socket file nobody listened on", path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(backlog)
        inode = os.lstat(path).st_ino
    except OSError as e:
        sock.close()
        raise PortBusyError(f"--uds {path}: cannot listen there: {e.strerror}") from None
    sock.setblocking(False)
    return UnixListener(sock, path, inode)


def listen_address(frontend: FrontendConfig) -> str:
    """Where clients reach the server, for the ready line (vLLM's forms)."""
    if frontend.uds:
        return f"unix:{frontend.uds}"
    scheme = "grpc" if frontend.grpc else "https" if frontend.ssl_certfile else "http"
    host = (frontend.host or "0.0.0.0").strip("[]")
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{frontend.port}"


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # e.g. a full backlog: someone listens
    finally:
        probe.close()
    return True
