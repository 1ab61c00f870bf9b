"""ZMQ socket and address helpers shared by the API servers, engines and supervisor.

Addresses are always *reported* after binding (LAST_ENDPOINT), never pre-picked:
bind to port 0 / "*" and publish what the kernel chose.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

import zmq

# The ZAP domain of every CURVE server socket; keys.start_authenticator answers for it.
ZAP_DOMAIN = b"zserve"


@dataclass(frozen=True)
class CurveKeys:
    """The deployment's CURVE key pair (Z85 bytes), shared by every node; see keys.py."""

    public: bytes
    secret: bytes


def is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def tcp_address(host: str, port: int | str) -> str:
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if is_ipv6(host) else f"tcp://{host}:{port}"


def ipc_address(directory: str, name: str) -> str:
    return f"ipc://{os.path.join(directory, name)}"


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    curve: CurveKeys | None = None,
    curve_server: bool = False,
    identity: bytes | None = None,
    linger_ms: int = 0,
) -> zmq.Socket:
    """A socket with zserve's options: unbounded queues (the engine must never block
    on a slow API server), IPv6 allowed, optional CURVE."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.IPV6, 1)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if curve is not None:
        if curve_server:
            sock.curve_server = True
            sock.curve_secretkey = curve.secret
            sock.curve_publickey = curve.public
            _require_zap(sock)
        else:
            # Clients pin the server's public key (the deployment's, as every node
            # holds the same pair) and present that pair; the server's ZAP handler
            # admits that public key only (protocol/keys.py).
            sock.curve_serverkey = curve.public
            sock.curve_publickey = curve.public
            sock.curve_secretkey = curve.secret
    return sock


def _require_zap(sock: zmq.Socket) -> None:
    """Fail closed: a CURVE server admits a client only if its context's ZAP handler
    (keys.start_authenticator) says yes. Without ZAP_ENFORCE_DOMAIN, libzmq admits
    every key when no handler runs (one not started, or already stopped)."""
    sock.zap_domain = ZAP_DOMAIN
    try:
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except (AttributeError, zmq.ZMQError):
        pass  # a libzmq without the option: the handler, started before bind, still decides


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind and return the endpoint actually bound (port 0 → the chosen port)."""
    if address.startswith("tcp://") and address.rsplit(":", 1)[1] == "0":
        address = address.rsplit(":", 1)[0] + ":*"
    sock.bind(address)
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    endpoint = endpoint.decode() if isinstance(endpoint, bytes) else endpoint
    # An IPv6-enabled socket reports an IPv4 bind as [::ffff:a.b.c.d]; peers get the
    # plain form, which works whether or not they enable IPv6.
    if endpoint.startswith("tcp://[::ffff:") and "." in endpoint:
        host, port = endpoint[len("tcp://[::ffff:") :].split("]:")
        endpoint = tcp_address(host, port)
    return endpoint


def needs_curve(address: str) -> bool:
    """TCP links may cross nodes and are encrypted; ipc:// stays on one node."""
    return address.startswith("tcp://")


def rank_identity(rank: int) -> bytes:
    """An engine's DEALER identity: its data-parallel rank, 2 bytes little-endian."""
    return rank.to_bytes(2, "little")


def identity_rank(identity: bytes) -> int:
    return int.from_bytes(identity, "little")
