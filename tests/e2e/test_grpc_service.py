"""`zserve serve --grpc`: every RPC of smg-grpc-proto's VllmEngine service through a plain
grpcio client, over TLS with an API key, against two API servers and two engines."""

from __future__ import annotations

import hashlib
import io
import re
import threading
import zipfile
from pathlib import Path

import grpc
import pytest
import tokenizers
from e2e_grpc import (
    GRPCZServe,
    api_server_pids,
    chunks,
    completes,
    generate,
    request_counts,
)
from e2e_otlp import OTLPCollector
from e2e_tls import CertificateAuthority, have_openssl
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated.vllm_engine_pb2_grpc import VllmEngineStub
from zserve_proc import wait_for

pytestmark = pytest.mark.timeout(300)

KEY = "grpc-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
VOCAB_SIZE = 320
# The tiny llama with a long context: a Blocker's stream of MAX_MODEL_LEN - 4 tokens
# lives ~16 s on one thread here, so tests can look at requests waiting behind it for as
# long as they need (the gRPC door has no /pause to hold it, as the HTTP tests' has).
MAX_MODEL_LEN = 16384
MAX_QUEUED_REQS = 3
MAX_BODY = 256 * 1024
PROMPT = [72, 101, 108, 108, 111]  # "Hello"


@pytest.fixture(scope="module")
def collector():
    with OTLPCollector() as c:
        yield c


@pytest.fixture(scope="module")
def server(tiny_model, long_context, tmp_path_factory, collector):
    tls, ca, client = (), None, None
    if have_openssl():  # TLS that requires client certificates from the test's CA
        authority = CertificateAuthority(tmp_path_factory.mktemp("tls"))
        key, cert = authority.issue("server", server=True)
        ca, client = authority.cert, authority.issue("client", server=False)
        tls = ("--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
               "--ssl-ca-certs", str(ca), "--ssl-cert-reqs", "2")  # fmt: skip
    with GRPCZServe(
        str(long_context(tiny_model("llama"), MAX_MODEL_LEN)),
        "--served-model-name", "tiny",
        "--api-key", KEY,
        *tls,
        "--api-server-count", "2",
        "--data-parallel-size", "2",
        "--kv-cache-memory-bytes", "64MiB",
        "--device", "cpu",
        "--max-num-seqs", "1",  # one running slot per engine, for a Blocker to hold
        "--cpu-threads", "1",  # two engines beside two API servers on the box's cores
        "--max-num-queued-reqs", str(MAX_QUEUED_REQS),
        "--max-request-body-bytes", str(MAX_BODY),
        "--max-concurrent-streams", "16",
        "--otlp-traces-endpoint", collector.endpoint,
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # spans leave within 0.1 s
        ca=ca,
        client=client,
    ) as s:  # fmt: skip
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def channel(server):
    with server.channel() as c:
        yield c


@pytest.fixture(scope="module")
def stub(channel):
    return VllmEngineStub(channel)


def loads(stub, rank: int) -> pb.SchedulerLoad:
    return stub.GetLoads(pb.GetLoadsRequest(dp_rank=rank), metadata=AUTH, timeout=10).loads[0]


class Blocker:
    """A long stream pinned to one engine: it holds that engine's only running slot
    until cancelled."""

    def __init__(self, stub, rank: int = 0, request_id: str = "blocker") -> None:
        request = pb.GenerateRequest(
            request_id=request_id,
            tokenized=pb.TokenizedInput(input_ids=[66] * 4),
            sampling_params=pb.SamplingParams(max_tokens=MAX_MODEL_LEN - 4, ignore_eos=True),
            stream=True,
            data_parallel_rank=rank,
        )
        self.call = stub.Generate(request, metadata=AUTH, timeout=120)
        next(self.call)  # its first token: it runs

    def release(self) -> None:
        self.call.cancel()


class Waiter:
    """A request that waits behind a Blocker, read in a thread."""

    def __init__(self, stub, rank: int = 0, request_id: str = "waiter", n: int = 1) -> None:
        request = pb.GenerateRequest(
            request_id=request_id,
            tokenized=pb.TokenizedInput(input_ids=[67] * 8),
            sampling_params=pb.SamplingParams(max_tokens=4, temperature=0, n=n),
            stream=True,
            data_parallel_rank=rank,
        )
        self.call = stub.Generate(request, metadata=AUTH, timeout=120)
        self.responses: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        try:
            self.responses.extend(self.call)
        except grpc.RpcError as e:
            self.error = e

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive()


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    """The error a call ends with (a streaming call is read to its end)."""
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
    return info.value


# --- auth and transport ---------------------------------------------------------------


def test_health_check_answers_without_the_api_key(stub):
    response = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
    assert response.healthy and response.message


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),)],
    ids=["none", "wrong-key", "no-scheme"],
)
def test_every_other_rpc_needs_the_api_key(stub, metadata):
    for call in (
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10),
        lambda: generate(stub, PROMPT, metadata, max_tokens=2),
        lambda: list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=metadata)),
        lambda: stub.Abort(pb.AbortRequest(request_ids=["x"]), metadata=metadata, timeout=10),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in info.value.details()


def test_the_bearer_scheme_is_case_insensitive(stub):
    info = stub.GetModelInfo(
        pb.GetModelInfoRequest(), metadata=(("authorization", f"bEaReR {KEY}"),), timeout=10
    )
    assert info.served_model_name == "tiny"


def test_tls_serves_tls_only_and_only_to_clients_with_a_certificate_from_the_ca(server):
    if server.cert is None:
        pytest.skip("no openssl to make a certificate")
    no_client_cert = grpc.ssl_channel_credentials(server.cert)
    for channel in (
        grpc.insecure_channel(server.target),
        grpc.secure_channel(server.target, no_client_cert),
    ):
        with channel, pytest.raises(grpc.RpcError) as info:
            VllmEngineStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# --- what the server is ------------------------------------------------------------------


def test_model_info_describes_the_served_model_without_its_path(stub, tiny_model):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
    assert info.served_model_name == "tiny" and info.model_path == "tiny"
    assert info.is_generation and not info.supports_vision
    assert info.max_context_length == MAX_MODEL_LEN and info.max_req_input_len == MAX_MODEL_LEN - 1
    assert info.vocab_size == VOCAB_SIZE
    assert list(info.architectures) == ["LlamaForCausalLM"] and info.model_type == "llama"
    assert list(info.eos_token_ids) == [258]
    assert str(tiny_model("llama")) not in str(info)


def test_server_info_and_loads_report_every_engine(stub):
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=AUTH, timeout=10)
    assert info.data_parallel_size == 2 and info.block_size == 16
    assert info.server_type == "zserve-grpc" and info.uptime_seconds > 0
    all_loads = stub.GetLoads(pb.GetLoadsRequest(), metadata=AUTH, timeout=10)
    assert all_loads.dp_rank_count == 2
    assert [load.dp_rank for load in all_loads.loads] == [0, 1]
    assert all(load.max_total_num_tokens > 0 for load in all_loads.loads)
    assert loads(stub, 1).dp_rank == 1
    error = rpc_error(stub.GetLoads, pb.GetLoadsRequest(dp_rank=2), metadata=AUTH, timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ranks 0..1" in error.details()


def test_get_tokenizer_streams_the_tokenizer_files(stub, tiny_model):
    parts = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=AUTH, timeout=30))
    data = b"".join(p.data for p in parts)
    assert parts[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not p.sha256 for p in parts[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = set(zf.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
        assert "model.safetensors" not in names
        tok = tokenizers.Tokenizer.from_str(zf.read("tokenizer.json").decode())
    local = tokenizers.Tokenizer.from_file(str(Path(tiny_model("llama")) / "tokenizer.json"))
    assert tok.encode("Hello, gRPC").ids == local.encode("Hello, gRPC").ids


def test_the_api_servers_never_imported_torch(server):
    pids = api_server_pids(server)
    assert len(pids) == 2
    for pid in pids:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()


# --- generation ------------------------------------------------------------------------


def test_streamed_and_final_greedy_outputs_agree(stub):
    final = completes(generate(stub, PROMPT, AUTH, max_tokens=12, temperature=0, ignore_eos=True))
    assert len(final) == 1
    done = final[0]
    assert done.finish_reason == "length" and done.completion_tokens == 12
    assert done.prompt_tokens == len(PROMPT) and len(done.output_ids) == 12
    streamed = generate(
        stub, PROMPT, AUTH, stream=True, max_tokens=12, temperature=0, ignore_eos=True
    )
    assert streamed[-1].WhichOneof("response") == "complete"
    ids = [t for c in chunks(streamed) for t in c.token_ids]
    assert ids == list(done.output_ids) == list(completes(streamed)[0].output_ids)
    assert sum(c.completion_tokens for c in chunks(streamed)) == 12


def test_logprobs_and_prompt_logprobs(stub):
    done = completes(
        generate(stub, PROMPT, AUTH, max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=1)
    )[0]
    out = done.output_logprobs
    assert list(out.token_ids) == list(done.output_ids)
    assert len(out.token_logprobs) == 3 and all(v <= 0 for v in out.token_logprobs)
    assert all(len(top.token_ids) == 2 for top in out.top_logprobs)
    # Greedy: the sampled token is the best alternative.
    assert all(top.token_ids[0] == t for top, t in zip(out.top_logprobs, out.token_ids))
    prompt = done.input_logprobs
    assert list(prompt.token_ids) == PROMPT
    assert not prompt.token_logprobs[0].HasField("value")
    assert all(e.HasField("value") for e in prompt.token_logprobs[1:])
    streamed = chunks(
        generate(stub, PROMPT, AUTH, stream=True, max_tokens=3, temperature=0, logprobs=0)
    )
    assert [c.output_logprobs.token_ids[0] for c in streamed] == list(done.output_ids)
    assert not any(c.output_logprobs.top_logprobs for c in streamed)


def test_stop_token_ids_and_stop_strings_end_generation(stub, tiny_model):
    greedy = dict(temperature=0, ignore_eos=True)
    ids = list(completes(generate(stub, PROMPT, AUTH, max_tokens=10, **greedy))[0].output_ids)
    stop_id = ids[3]
    done = completes(
        generate(stub, PROMPT, AUTH, max_tokens=10, stop_token_ids=[stop_id], **greedy)
    )
    assert done[0].finish_reason == "stop" and done[0].matched_token_id == stop_id
    assert list(done[0].output_ids) == ids[: ids.index(stop_id) + 1]
    tok = tokenizers.Tokenizer.from_file(str(Path(tiny_model("llama")) / "tokenizer.json"))
    texts = [tok.decode([t]) for t in ids[2:8]]
    stop = next(t for t in texts if len(t) == 1 and t.isprintable() and t != "\ufffd")
    for stream in (False, True):
        responses = generate(
            stub, PROMPT, AUTH, stream=stream, max_tokens=10, stop=[stop],
            skip_special_tokens=True, **greedy,
        )  # fmt: skip
        done = completes(responses)[0]
        assert done.finish_reason == "stop" and done.matched_stop_str == stop
        assert len(done.output_ids) < 10 and stop in tok.decode(list(done.output_ids))


def test_structured_output_constraints_decide_the_text(stub, tiny_model):
    """The constraint oneof maps onto the engine's structured outputs, as over HTTP."""
    tok = tokenizers.Tokenizer.from_file(str(Path(tiny_model("llama")) / "tokenizer.json"))
    choices = ["sunny", "rainy"]
    for stream in (False, True):
        for seed in range(3):
            done = completes(
                generate(
                    stub, PROMPT, AUTH, stream=stream, max_tokens=20, temperature=1.0, seed=seed,
                    choice=pb.ChoiceConstraint(choices=choices), skip_special_tokens=True,
                )
            )[0]  # fmt: skip
            text = tok.decode(list(done.output_ids), skip_special_tokens=True)
            assert text in choices, text
    done = completes(generate(stub, PROMPT, AUTH, max_tokens=20, regex="[0-9]{3}"))[0]
    assert re.fullmatch("[0-9]{3}", tok.decode(list(done.output_ids), skip_special_tokens=True))


def test_seeds_repeat_and_n_gives_every_choice(stub):
    params = dict(max_tokens=6, temperature=1.0, seed=7, n=2)
    first = sorted(completes(generate(stub, PROMPT, AUTH, **params)), key=lambda c: c.index)
    again = sorted(completes(generate(stub, PROMPT, AUTH, **params)), key=lambda c: c.index)
    assert [c.index for c in first] == [0, 1]
    assert [list(c.output_ids) for c in first] == [list(c.output_ids) for c in again]
    streamed = generate(stub, PROMPT, AUTH, stream=True, **params)
    assert {c.index for c in completes(streamed)} == {0, 1}


def test_text_input_is_tokenized_by_the_server(stub, tiny_model):
    tok = tokenizers.Tokenizer.from_file(str(Path(tiny_model("llama")) / "tokenizer.json"))
    request = pb.GenerateRequest(
        request_id="text",
        text="Hello",
        sampling_params=pb.SamplingParams(max_tokens=2, temperature=0),
    )
    done = completes(list(stub.Generate(request, metadata=AUTH, timeout=60)))[0]
    assert done.prompt_tokens == len(tok.encode("Hello").ids)


def test_requests_spread_over_engines_and_api_servers(server):
    engines, api_servers = set(), set()
    for i in range(40):
        with server.channel() as channel:  # the kernel spreads connections, not requests
            call = VllmEngineStub(channel).Generate(
                pb.GenerateRequest(
                    request_id=f"spread-{i}",
                    tokenized=pb.TokenizedInput(input_ids=PROMPT),
                    sampling_params=pb.SamplingParams(max_tokens=1),
                ),
                metadata=AUTH,
                timeout=60,
            )
            metadata = dict(call.initial_metadata())
            list(call)
        engines.add(metadata["x-engine-rank"])
        api_servers.add(metadata["x-api-server"])
        if len(engines) == len(api_servers) == 2:
            break
    assert engines == {"0", "1"} and api_servers == {"0", "1"}


def test_a_pinned_rank_is_honoured(stub):
    for rank in (0, 1):
        call = stub.Generate(
            pb.GenerateRequest(
                request_id="pinned",
                tokenized=pb.TokenizedInput(input_ids=PROMPT),
                sampling_params=pb.SamplingParams(max_tokens=1),
                data_parallel_rank=rank,
            ),
            metadata=AUTH,
            timeout=60,
        )
        assert dict(call.initial_metadata())["x-engine-rank"] == str(rank)
        list(call)


# --- bad input -------------------------------------------------------------------------


BAD = {
    "temperature": (dict(sampling_params=pb.SamplingParams(temperature=500)), "sampling_params.temperature"),
    "top_p": (dict(sampling_params=pb.SamplingParams(top_p=1.5)), "sampling_params.top_p"),
    "nan": (dict(sampling_params=pb.SamplingParams(min_p=float("nan"))), "sampling_params.min_p"),
    "out_of_vocab": (dict(tokenized=pb.TokenizedInput(input_ids=[1, 99999])), "tokenized.input_ids"),
    "empty_prompt": (dict(tokenized=pb.TokenizedInput(input_ids=[])), "tokenized.input_ids"),
    "no_input": (dict(tokenized=None), "tokenized"),
    "too_long": (dict(tokenized=pb.TokenizedInput(input_ids=[5] * MAX_MODEL_LEN)), "tokenized.input_ids"),
    "max_tokens_0": (dict(sampling_params=pb.SamplingParams(max_tokens=0)), "sampling_params.max_tokens"),
    "max_tokens_big": (dict(sampling_params=pb.SamplingParams(max_tokens=MAX_MODEL_LEN + 1)), "sampling_params.max_tokens"),
    "logprobs": (dict(sampling_params=pb.SamplingParams(logprobs=50)), "--max-logprobs"),
    "all_logprobs": (dict(sampling_params=pb.SamplingParams(logprobs=-1)), "sampling_params.logprobs"),
    "n": (dict(sampling_params=pb.SamplingParams(n=5000)), "sampling_params.n"),
    "stop_count": (dict(sampling_params=pb.SamplingParams(stop=["x"] * 100)), "sampling_params.stop"),
    "stop_token": (dict(sampling_params=pb.SamplingParams(stop_token_ids=[4000])), "sampling_params.stop_token_ids"),
    "logit_bias": (dict(sampling_params=pb.SamplingParams(logit_bias={9999: 1.0})), "sampling_params.logit_bias"),
    "min_tokens": (dict(sampling_params=pb.SamplingParams(max_tokens=2, min_tokens=5)), "sampling_params.min_tokens"),
    "json_schema": (dict(sampling_params=pb.SamplingParams(json_schema="{not json")), "sampling_params.json_schema"),
    "regex": (dict(sampling_params=pb.SamplingParams(regex="(unclosed")), "sampling_params.regex"),
    "choice": (dict(sampling_params=pb.SamplingParams(choice=pb.ChoiceConstraint(choices=[]))), "sampling_params.choice"),
    "rank": (dict(data_parallel_rank=7), "data_parallel_rank"),
    "request_id": (dict(request_id="r" * 1000), "request_id"),
    "multimodal": (dict(mm_inputs=pb.MultimodalInputs(mm_hashes=["h"])), "mm_inputs"),
    "kv_transfer": (dict(kv_transfer_params_json="{}"), "kv_transfer_params_json"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_invalid_argument_naming_the_field(stub, case):
    fields, named = BAD[case]
    request = {
        "request_id": "bad",
        "tokenized": pb.TokenizedInput(input_ids=PROMPT),
        "sampling_params": pb.SamplingParams(max_tokens=2),
        **fields,
    }
    request = pb.GenerateRequest(**{k: v for k, v in request.items() if v is not None})
    error = rpc_error(lambda: list(stub.Generate(request, metadata=AUTH, timeout=30)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert named in error.details()


def test_unsupported_rpcs_say_so(stub):
    error = rpc_error(stub.Embed, pb.EmbedRequest(request_id="e"), metadata=AUTH, timeout=10)
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED and "--runner pooling" in error.details()
    # Without --profiler-config the engines refuse, and the answer says why.
    for call, request in (
        (stub.StartProfile, common_pb2.StartProfileRequest()),
        (stub.StopProfile, common_pb2.StopProfileRequest()),
    ):
        answer = call(request, metadata=AUTH, timeout=10)
        assert not answer.success and "profiler" in answer.message


def test_flush_cache_resets_every_engine(stub):
    assert stub.FlushCache(common_pb2.FlushCacheRequest(), metadata=AUTH, timeout=30).success
    for bad in (float("nan"), -1.0, 1e9):
        error = rpc_error(
            stub.FlushCache, common_pb2.FlushCacheRequest(timeout_s=bad), metadata=AUTH, timeout=10
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in error.details()


# --- the life of a request ---------------------------------------------------------------


def test_a_cancelled_rpc_frees_its_request_in_the_engine(server, stub):
    before = request_counts(server).get("abort", 0)
    blocker = Blocker(stub)
    try:
        waiter = Waiter(stub)
        wait_for(lambda: loads(stub, 0).num_waiting_reqs == 1, "a waiting request", timeout=60)
        waiter.call.cancel()
        waiter.join()
        assert waiter.error.code() == grpc.StatusCode.CANCELLED
        # Only an ABORT takes a request out of the queue while the blocker runs.
        wait_for(
            lambda: loads(stub, 0).num_waiting_reqs == 0, "the waiting request to go", timeout=60
        )
        assert loads(stub, 0).num_running_reqs == 1
        blocker.release()
        wait_for(lambda: loads(stub, 0).num_running_reqs == 0, "the blocker to go", timeout=60)
    finally:
        blocker.release()
    wait_for(
        lambda: request_counts(server).get("abort", 0) == before + 2,
        "two aborts counted",
        timeout=60,
    )


def test_abort_ends_a_waiting_request_with_finish_reason_abort(stub):
    blocker = Blocker(stub)
    try:
        waiter = Waiter(stub, request_id="to-abort", n=2)
        wait_for(lambda: loads(stub, 0).num_waiting_reqs == 2, "two waiting sequences", timeout=60)
        stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]), metadata=AUTH, timeout=10)
        waiter.join()
        assert waiter.error is None
        done = completes(waiter.responses)
        assert sorted(c.index for c in done) == [0, 1]
        assert all(c.finish_reason == "abort" and not c.output_ids for c in done)
        wait_for(
            lambda: loads(stub, 0).num_waiting_reqs == 0, "the aborted requests to go", timeout=60
        )
    finally:
        blocker.release()


def test_admission_limits_are_resource_exhausted(stub):
    blocker = Blocker(stub)  # 1 request of MAX_QUEUED_REQS
    waiters = []
    try:
        waiters.append(Waiter(stub, n=2))
        wait_for(lambda: loads(stub, 0).num_waiting_reqs == 2, "two waiting sequences", timeout=60)
        error = rpc_error(generate, stub, PROMPT, AUTH, max_tokens=2)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-num-queued-reqs" in error.details()
    finally:
        blocker.release()
    for waiter in waiters:
        waiter.join()
        assert waiter.error is None and len(completes(waiter.responses)) == 2


# --- hostile input -------------------------------------------------------------------------


def test_hostile_messages_leave_the_server_responsive(server, channel, stub):
    def healthy() -> bool:
        return stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy

    # Larger than --max-request-body-bytes: refused by the transport.
    huge = pb.GenerateRequest(
        request_id="huge", tokenized=pb.TokenizedInput(input_ids=[300] * MAX_BODY)
    )
    error = rpc_error(lambda: list(stub.Generate(huge, metadata=AUTH, timeout=30)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert healthy()
    # The largest message allowed: a prompt far past the context, refused before its ids
    # are copied.
    biggest = pb.GenerateRequest(
        request_id="biggest", tokenized=pb.TokenizedInput(input_ids=[1] * (MAX_BODY - 64))
    )
    error = rpc_error(lambda: list(stub.Generate(biggest, metadata=AUTH, timeout=30)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum context length" in error.details()
    assert healthy()
    # Bytes that are no GenerateRequest at all.
    raw = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
    for garbage in (b"\xff" * 64, b"\x12\xff\xff\xff\xff\x0f", bytes(range(256)) * 8):
        error = rpc_error(lambda g=garbage: list(raw(g, metadata=AUTH, timeout=10)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GenerateRequest" in error.details()
    assert healthy()
    # Metadata past --max-header-bytes.
    error = rpc_error(
        stub.GetModelInfo,
        pb.GetModelInfoRequest(),
        metadata=(*AUTH, ("x-junk", "j" * 200_000)),
        timeout=10,
    )
    assert error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
    assert healthy()
    # A method the service does not have.
    error = rpc_error(channel.unary_unary("/vllm.grpc.engine.VllmEngine/Nope"), b"", metadata=AUTH)
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_generate_with_a_trace_context_is_a_span_under_the_callers_trace(stub, collector):
    """The call's W3C traceparent (gRPC metadata) parents its llm_request span, as the
    header does over HTTP; a call without one starts a trace of its own."""
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traced = (*AUTH, ("traceparent", f"00-{trace_id}-{parent}-01"))
    generate(stub, PROMPT, traced, request_id="grpc-traced", max_tokens=2)
    generate(stub, PROMPT, AUTH, request_id="grpc-own", max_tokens=2)
    wait_for(
        lambda: all(
            collector.with_attribute("gen_ai.request.id", r) for r in ("grpc-traced", "grpc-own")
        ),
        "the spans at the collector",
        timeout=20,
    )
    (span,) = collector.with_attribute("gen_ai.request.id", "grpc-traced")
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
    assert span.attributes["gen_ai.usage.completion_tokens"] == 2
    (own,) = collector.with_attribute("gen_ai.request.id", "grpc-own")
    assert own.trace_id != trace_id and own.parent_span_id == ""
