"""The real client of `zserve serve --grpc`: the Shepherd Model Gateway (`smg`, a Rust
gateway shipped in its wheel) routes OpenAI HTTP requests to one and to two zserve gRPC
workers, driven by the official `openai` client.

Oracle: the gateway tokenizes and detokenizes itself, so its greedy answer must be the
text of the token ids the same worker generates for the same prompt ids over plain gRPC.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import tokenizers
import torch
from e2e_grpc import GRPCZServe, completes, generate, request_counts
from hf_generate import reference_model
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated.vllm_engine_pb2_grpc import VllmEngineStub
from zserve_proc import free_port, new_log_path, wait_for

pytestmark = pytest.mark.timeout(300)

SMG = shutil.which("smg", path=os.path.dirname(sys.executable)) or shutil.which("smg")
if SMG is None:
    pytest.skip("the SMG gateway is not installed (pip install smg)", allow_module_level=True)

MODEL = "tiny"
WORKER_FLAGS = ("--served-model-name", MODEL, "--kv-cache-memory-bytes", "16MiB", "--device", "cpu")


class Gateway:
    """`smg launch` in its own process group, ready when every worker is registered and
    ready and the model's tokenizer is loaded: the gateway lists the model as soon as its
    first worker is registered, but answers 503 `tokenizer_not_ready` until the model's own
    tokenizer, loaded by a background job after that, is in its registry."""

    def __init__(self, model_path: Path, workers: list[GRPCZServe]) -> None:
        self.port = free_port()
        self.worker_urls = {f"grpc://{w.target}" for w in workers}
        self.log_path = new_log_path("smg-test-")
        self.args = [
            SMG, "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *sorted(self.worker_urls),
            "--model-path", str(model_path), "--policy", "round_robin",
            "--prometheus-port", str(free_port()),  # two gateways may run at once
            # At the end of a module no request is in flight: a kept-alive client
            # connection must not hold the exit for the default 180 s (then SIGKILL).
            "--shutdown-grace-period-secs", "1",
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Gateway:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_for(self._is_ready, "the gateway's workers and tokenizer", timeout=60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _is_ready(self) -> bool:
        assert self.proc.poll() is None, self.log()
        try:
            workers = httpx.get(self.base_url + "/workers", timeout=2)
            tokenizers = httpx.get(self.base_url + "/v1/tokenizers", timeout=2)
        except httpx.HTTPError:
            return False
        if workers.status_code != 200 or tokenizers.status_code != 200:
            return False
        ready = {
            w["url"]
            for w in workers.json().get("workers", [])
            if w.get("is_healthy") and w.get("status") == "ready"
        }
        loaded = {t["name"] for t in tokenizers.json().get("tokenizers", [])}
        return ready == self.worker_urls and MODEL in loaded

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


@pytest.fixture(scope="module")
def workers(tiny_model):
    with (
        GRPCZServe(str(tiny_model("llama")), *WORKER_FLAGS, wait_ready=False) as a,
        GRPCZServe(str(tiny_model("llama")), *WORKER_FLAGS, wait_ready=False) as b,
    ):
        a.wait_until_ready()  # both start at once
        b.wait_until_ready()
        yield a, b
        logs = a.log() + b.log()
    assert "Traceback" not in logs, logs[-4000:]


@pytest.fixture(scope="module", params=[1, 2], ids=["one-worker", "two-workers"])
def gateway(request, workers, tiny_model):
    with Gateway(tiny_model("llama"), list(workers[: request.param])) as g:
        g.workers = workers[: request.param]
        yield g


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(Path(tiny_model("llama")) / "tokenizer.json"))


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key="none", max_retries=0, timeout=60
    )


def direct_text(worker: GRPCZServe, tokenizer, ids: list[int], max_tokens: int) -> str:
    """What the worker generates greedily for these prompt ids, as text."""
    with worker.channel() as channel:
        done = completes(
            generate(
                VllmEngineStub(channel), ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
            )
        )[0]
    return tokenizer.decode(list(done.output_ids))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_through_the_gateway(gateway, tokenizer, stream):
    prompt = "The gateway says"
    oai = client(gateway)
    kwargs = dict(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    if stream:
        parts = list(
            oai.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        )
        text = "".join(p.choices[0].text for p in parts if p.choices)
        usage = parts[-1].usage
        finish = [
            p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason
        ]
    else:
        response = oai.completions.create(**kwargs)
        text, usage = response.choices[0].text, response.usage
        finish = [response.choices[0].finish_reason]
    assert finish == ["length"]
    assert usage.completion_tokens == 8
    ids = tokenizer.encode(prompt).ids
    assert usage.prompt_tokens == len(ids)
    assert text == direct_text(gateway.workers[0], tokenizer, ids, 8)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_through_the_gateway(gateway, stream):
    oai = client(gateway)
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    if stream:
        parts = list(oai.chat.completions.create(stream=True, **kwargs))
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        finish = [
            p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason
        ]
        again = "".join(
            p.choices[0].delta.content or ""
            for p in oai.chat.completions.create(stream=True, **kwargs)
            if p.choices
        )
    else:
        response = oai.chat.completions.create(**kwargs)
        text, finish = response.choices[0].message.content, [response.choices[0].finish_reason]
        assert response.usage.completion_tokens == 6
        again = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert finish == ["length"]
    assert text and text == again  # greedy: every worker answers alike


def test_the_gateway_spreads_requests_over_its_workers(gateway):
    """round_robin: with two workers, each serves its share."""
    before = [sum(request_counts(w).values()) for w in gateway.workers]
    oai = client(gateway)
    for i in range(6):
        oai.completions.create(model=MODEL, prompt=f"spread {i}", max_tokens=2)
    served = [sum(request_counts(w).values()) - b for w, b in zip(gateway.workers, before)]
    assert sum(served) == 6 and all(served), served


def test_a_stop_string_ends_the_answer_through_the_gateway(gateway, tokenizer):
    oai = client(gateway)
    base = (
        oai.completions.create(
            model=MODEL,
            prompt="stop here",
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = next(c for c in base[2:8] if c.isprintable() and c != "\ufffd" and not c.isspace())
    response = oai.completions.create(
        model=MODEL, prompt="stop here", max_tokens=10, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == base[: base.index(stop)]
    assert response.usage.completion_tokens < 10


# --- an embedding worker (--runner pooling): the gateway's /v1/embeddings over Embed -------


@pytest.fixture(scope="module")
def pooling_gateway(tiny_model):
    with GRPCZServe(str(tiny_model("llama")), *WORKER_FLAGS, "--runner", "pooling") as worker:
        with Gateway(tiny_model("llama"), [worker]) as g:
            g.workers = [worker]
            yield g
        log = worker.log()
    assert "Traceback" not in log, log[-4000:]


def test_the_gateway_embeds_through_the_embed_rpc(pooling_gateway, tiny_model, tokenizer):
    # One input per call: this gateway sends a list of inputs as one Embed of them all.
    model = reference_model(tiny_model("llama"))
    for text in ("hello world", "def f(x): return x"):
        result = client(pooling_gateway).embeddings.create(
            model=MODEL, input=text, encoding_format="float"
        )
        (data,) = result.data
        ids = tokenizer.encode(text).ids
        assert result.usage.prompt_tokens == len(ids)
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        expected = (hidden / hidden.norm()).numpy()
        assert max(abs(a - b) for a, b in zip(data.embedding, expected)) < 1e-4
    assert sum(request_counts(pooling_gateway.workers[0]).values()) >= 2


def test_embed_answers_and_refuses_by_name(pooling_gateway):
    (worker,) = pooling_gateway.workers
    with worker.channel() as channel:
        stub = VllmEngineStub(channel)
        ids = [72, 101, 108, 108, 111]
        answer = stub.Embed(
            pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_ids=ids))
        )
        assert answer.prompt_tokens == 5 and answer.embedding_dim == len(answer.embedding) == 64
        by_text = stub.Embed(
            pb.EmbedRequest(tokenized=pb.TokenizedInput(original_text="Hello")), timeout=10
        )
        assert by_text.embedding_dim == 64
        assert not stub.GetModelInfo(pb.GetModelInfoRequest()).is_generation
        for request, named in (
            (pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[999])), "tokenized.input_ids"),
            (
                pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1] * 1025)),
                "tokenized.input_ids",
            ),
            (pb.EmbedRequest(), "tokenized"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.Embed(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert named in info.value.details(), info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids))))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "use Embed" in info.value.details()
