"""Start-up handshake between the supervisor and each engine core.

engine → supervisor   HELLO  {version, rank, local, headless}
supervisor → engine   PLAN   {version, the API servers' input and output addresses}
engine → supervisor   READY  (an EngineReady, after the model is loaded and warmed up)

Every handshake message starts with the protocol version, so a peer of another
version is named as such instead of failing on an unreadable struct.
"""

from __future__ import annotations

import msgspec

from protocol.messages import PROTOCOL_VERSION, EngineReady, LoraConfig, _Wire


class ProtocolVersionError(RuntimeError):
    """The two sides of a link speak different protocol versions."""


class EngineHello(_Wire):
    protocol_version: int
    rank: int
    local: bool
    headless: bool
    pid: int = 0
    hostname: str = ""


class EnginePlan(_Wire):
    """Where an engine connects: one input (DEALER) and one output (PUSH) per API server;
    and the server's LoRA settings, which every engine, headless ones included, takes."""

    protocol_version: int
    input_addresses: list[str]
    output_addresses: list[str]
    error: str | None = None
    lora: LoraConfig | None = None


class HandshakeMessage(_Wire):
    """Envelope on the handshake socket: kind is "hello", "plan" or "ready"."""

    protocol_version: int
    kind: str
    body: msgspec.Raw


_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(list)
_bodies: dict[str, type] = {"hello": EngineHello, "plan": EnginePlan, "ready": EngineReady}


def encode_handshake(kind: str, body: msgspec.Struct) -> bytes:
    return _encoder.encode(
        HandshakeMessage(PROTOCOL_VERSION, kind, msgspec.Raw(_encoder.encode(body)))
    )


def decode_handshake(data: bytes) -> tuple[str, msgspec.Struct]:
    """Decode one handshake message; a peer of another protocol version raises
    ProtocolVersionError naming both versions."""
    try:
        raw = _envelope.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"undecodable handshake message ({len(data)} bytes): {e}") from e
    version = raw[0] if raw and isinstance(raw[0], int) else None
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"protocol version mismatch: peer speaks {version}, this zserve speaks "
            f"{PROTOCOL_VERSION}; run the same zserve version on every node"
        )
    try:
        msg = msgspec.msgpack.decode(data, type=HandshakeMessage)
        body_type = _bodies[msg.kind]
        return msg.kind, msgspec.msgpack.decode(msg.body, type=body_type)
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as e:
        raise ValueError(f"malformed handshake message: {e}") from e
