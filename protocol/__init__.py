"""Messages, framing and ZMQ helpers shared by every zserve process (stdlib, msgspec, pyzmq only)."""

from protocol.messages import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
