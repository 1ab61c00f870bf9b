"""The gRPC door's small translations: API keys on metadata, errors to status codes
naming the proto field, proto3 zeros to the server's defaults."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from frontend.admission import AdmissionRejected
from frontend.api_key import bearer_matches
from frontend.errors import APIError
from frontend.grpc_inputs import sampling_fields
from frontend.grpc_outputs import output_logprobs
from frontend.grpc_service import details_of, status_of
from protocol.messages import Logprobs


@pytest.mark.parametrize(
    "value, ok",
    [
        ("Bearer k3y", True),
        (b"bearer k3y", True),
        ("BEARER  k3y ", True),
        ("Basic k3y", False),
        ("k3y", False),
        ("Bearer k3y2", False),
        (None, False),
        ("Bearer \udcff", False),
    ],
)
def test_bearer_matches(value, ok):
    assert bearer_matches(value, b"k3y") is ok


def test_a_full_server_is_resource_exhausted_and_a_broken_one_unavailable():
    assert (
        status_of(AdmissionRejected("full", "max_num_queued_reqs"))
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert status_of(APIError("draining", 503)) == grpc.StatusCode.UNAVAILABLE
    assert status_of(APIError("bad", 400)) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(APIError("boom", 500)) == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    "message, param, details",
    [
        ("top_p: too big", "top_p", "sampling_params.top_p: too big"),
        ("n must be at most 4", "n", "sampling_params.n: n must be at most 4"),
        ("too long", "input_tokens", "tokenized.input_ids: too long"),
        ("request_id is long", "request_id", "request_id is long"),
        ("no field", None, "no field"),
    ],
)
def test_details_name_the_proto_field(message, param, details):
    assert details_of(APIError(message, param=param)) == details


def test_proto3_zeros_mean_the_servers_defaults():
    body = sampling_fields(pb.SamplingParams())
    assert (body.temperature, body.top_p, body.top_k, body.min_p) == (None, None, None, None)
    assert body.n == 1 and body.stop_strings == [] and body.seed is None
    body = sampling_fields(pb.SamplingParams(temperature=0, seed=0, n=3, stop=["x"]))
    assert (body.temperature, body.seed, body.n, body.stop_strings) == (0, 0, 3, ["x"])


def test_output_logprobs_carry_the_sampled_token_and_the_top_n():
    rows = Logprobs([[5, 5, 7], [9, 2, 9]], [[-0.1, -0.1, -2.0], [-1.5, -0.5, -1.5]], [1, 2])
    out = output_logprobs(rows, 2)
    assert list(out.token_ids) == [5, 9]
    assert list(out.token_logprobs) == pytest.approx([-0.1, -1.5])
    assert [list(t.token_ids) for t in out.top_logprobs] == [[5, 7], [2, 9]]
    assert not output_logprobs(rows, 0).top_logprobs
    assert output_logprobs(rows, None) is None
