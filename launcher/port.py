"""Claiming the HTTP port before anything starts (DESIGN.md §2).

1. A plain bind without SO_REUSEPORT fails if anyone holds the port — another
   zserve included, whose SO_REUSEPORT listeners would otherwise welcome us into
   their group and share its traffic with us.
2. A SO_REUSEPORT socket then holds the port for our API servers. It never listens:
   a listening one would take its share of new connections and never accept them.
   It has no SO_REUSEADDR, so a second zserve's plain bind (step 1) fails against it
   even while our API servers are still starting.
"""

from __future__ import annotations

import errno
import socket

from protocol.sockets import is_ipv6


class PortBusyError(RuntimeError):
    pass


def _family(host: str) -> int:
    return socket.AF_INET6 if is_ipv6(host) else socket.AF_INET


def claim_port(host: str | None, port: int) -> socket.socket:
    """Return the socket that holds (host, port) for this server's lifetime."""
    host = (host or "0.0.0.0").strip("[]")
    probe = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR only lets us past our own earlier connections in TIME_WAIT.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as e:
        probe.close()
        if e.errno == errno.EADDRINUSE:
            raise PortBusyError(
                f"port {port} on {host} is already in use (by another server, possibly "
                f"another zserve); choose another --port or stop that server"
            ) from None
        raise PortBusyError(f"cannot bind {host}:{port}: {e.strerror}") from None
    probe.close()
    holder = socket.socket(_family(host), socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        holder.bind((host, port))
    except OSError as e:
        holder.close()
        raise PortBusyError(f"port {port} on {host} was taken while starting: {e}") from None
    return holder
