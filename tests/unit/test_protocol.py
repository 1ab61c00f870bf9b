"""protocol/: wire round trips, forward compatibility, version checks."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from protocol import codec
from protocol.handshake import (
    EngineHello,
    EnginePlan,
    ProtocolVersionError,
    decode_handshake,
    encode_handshake,
)
from protocol.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    Logprobs,
    RequestType,
    SamplingParams,
    SchedulerStats,
    UtilityCall,
)
from protocol.sockets import bind, identity_rank, make_socket, rank_identity, tcp_address


def _request() -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r-1-abcd",
        prompt_token_ids=list(range(100)),
        sampling_params=SamplingParams(
            max_tokens=5,
            temperature=0.5,
            top_k=3,
            seed=7,
            stop_token_ids=[2],
            logit_bias={5: -100.0},
            logprobs=2,
        ),
        arrival_time=123.5,
        client_index=3,
        priority=-2,
        data_parallel_rank=1,
    )


def test_add_request_round_trips():
    req = _request()
    kind, back = codec.decode_request(codec.encode_request(RequestType.ADD, req))
    assert kind is RequestType.ADD and back == req


def test_abort_and_utility_round_trip():
    assert codec.decode_request(codec.encode_request(RequestType.ABORT, ["a", "b"])) == (
        RequestType.ABORT,
        ["a", "b"],
    )
    call = UtilityCall(9, "reset_prefix_cache", [0])
    assert codec.decode_request(codec.encode_request(RequestType.UTILITY, call))[1] == call


def test_outputs_round_trip_with_stats_and_logprobs():
    outs = EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput("a", [1, 2]),
            EngineCoreOutput(
                "b",
                [3],
                finish_reason=FinishReason.STOP,
                stop_reason=3,
                new_logprobs=Logprobs([[3, 4]], [[-0.1, -2.0]], [1]),
            ),
        ],
        scheduler_stats=SchedulerStats(num_running=2, kv_cache_usage=0.25, prefix_cache_hits=16),
        timestamp=5.0,
    )
    back = codec.decode_outputs(codec.encode(outs))
    assert back == outs
    assert back.outputs[1].finished and not back.outputs[0].finished
    assert back.outputs[1].finish_reason.openai_name == "stop"


def test_an_older_reader_tolerates_a_newer_trailing_field():
    # A future EngineCoreOutput: today's fields plus one appended at the end.
    fields = [
        (f.name, f.type, f.default) if f.default is not msgspec.NODEFAULT else (f.name, f.type)
        for f in msgspec.structs.fields(EngineCoreOutput)
    ]
    Newer = msgspec.defstruct(
        "NewerOutput",
        [*fields, ("some_future_field", str, "from the future")],
        array_like=True,
    )
    data = msgspec.msgpack.encode(Newer("x", [1], num_cached_tokens=4, some_future_field="hi"))
    old = msgspec.msgpack.decode(data, type=EngineCoreOutput)
    assert old.request_id == "x" and old.num_cached_tokens == 4


def test_a_newer_reader_fills_defaults_for_fields_an_older_writer_lacks():
    class OlderStats(msgspec.Struct, array_like=True):
        num_running: int
        num_waiting: int

    stats = msgspec.msgpack.decode(msgspec.msgpack.encode(OlderStats(1, 2)), type=SchedulerStats)
    assert stats.num_running == 1 and stats.num_waiting == 2 and stats.num_preemptions == 0


def test_handshake_round_trips():
    hello = EngineHello(PROTOCOL_VERSION, 1, False, True, 42, "node-b")
    assert decode_handshake(encode_handshake("hello", hello)) == ("hello", hello)
    plan = EnginePlan(PROTOCOL_VERSION, ["ipc:///x"], ["ipc:///y"])
    assert decode_handshake(encode_handshake("plan", plan)) == ("plan", plan)
    ready = EngineReady(PROTOCOL_VERSION, 0, 1024, 10, 16, "float32", "cpu")
    assert decode_handshake(encode_handshake("ready", ready))[1] == ready


def test_a_protocol_version_mismatch_is_a_clear_error():
    future = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, "hello", b"whatever layout"])
    with pytest.raises(ProtocolVersionError, match=r"peer speaks \d+, this zserve speaks \d+"):
        decode_handshake(future)


def test_garbage_is_a_decode_error_not_a_crash():
    with pytest.raises(codec.DecodeError):
        codec.decode_outputs(b"\xc1garbage")
    with pytest.raises(codec.DecodeError):
        codec.decode_request([b"\x00", b"not msgpack"])
    with pytest.raises(codec.DecodeError):
        codec.decode_request([b"\x09", b""])
    with pytest.raises(ValueError):
        decode_handshake(b"\xc1")


def test_rank_identity_is_two_bytes_little_endian():
    assert rank_identity(1) == b"\x01\x00" and identity_rank(b"\x02\x01") == 258


def test_bind_reports_the_port_actually_chosen():
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.PULL)
        endpoint = bind(sock, tcp_address("127.0.0.1", 0))
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        sock6 = make_socket(ctx, zmq.PULL)
        assert bind(sock6, tcp_address("::1", 0)).startswith("tcp://[::1]:")
    finally:
        ctx.destroy(linger=0)


def test_tcp_address_brackets_ipv6():
    assert tcp_address("::1", 5) == "tcp://[::1]:5"
    assert tcp_address("10.0.0.1", 5) == "tcp://10.0.0.1:5"
