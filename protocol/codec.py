"""Encoding and decoding of the data-plane messages (msgpack via msgspec).

Hot path: one encoder and one decoder per message type, created once and reused.
Nothing here ever unpickles; bytes that do not decode raise DecodeError, which
the receiving loop logs and drops.
"""

from __future__ import annotations

import msgspec

from protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    RequestType,
    UtilityCall,
)

DecodeError = (msgspec.DecodeError, msgspec.ValidationError, ValueError, KeyError, IndexError)

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

_decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
_decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
_decode_abort = msgspec.msgpack.Decoder(list[str]).decode
_decode_utility = msgspec.msgpack.Decoder(UtilityCall).decode
_decode_ready = msgspec.msgpack.Decoder(EngineReady).decode


def decode_outputs(data: bytes | memoryview) -> EngineCoreOutputs:
    return _decode_outputs(data)


def decode_ready(data: bytes | memoryview) -> EngineReady:
    return _decode_ready(data)


def encode_request(kind: RequestType, payload: object) -> list[bytes]:
    """Frames an API server sends (after the ROUTER's identity frame)."""
    return [kind.value, _encoder.encode(payload)]


def decode_request(
    frames: list[bytes],
) -> tuple[RequestType, EngineCoreRequest | list[str] | UtilityCall]:
    """Inverse of encode_request, as the engine's input thread sees it."""
    if len(frames) < 2:
        raise ValueError(f"request message has {len(frames)} frames, expected 2")
    kind = RequestType(bytes(frames[0]))
    payload = frames[1]
    if kind is RequestType.ADD:
        return kind, _decode_request(payload)
    if kind is RequestType.ABORT:
        return kind, _decode_abort(payload)
    return kind, _decode_utility(payload)
