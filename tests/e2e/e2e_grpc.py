"""What the gRPC e2e tests share: a `zserve serve --grpc` subprocess that is ready when
its HealthCheck says so, channels and stubs, and small readers of its state."""

from __future__ import annotations

import glob
import os
import tempfile
import time
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated.vllm_engine_pb2_grpc import VllmEngineStub
from zserve_proc import ZServe


class GRPCZServe(ZServe):
    """`zserve serve --grpc`; TLS when given the CA certificate to trust, with the
    client's (key, certificate) when the server asks for one."""

    def __init__(
        self, *args, ca: Path | None = None, client: tuple[Path, Path] | None = None, **kwargs
    ) -> None:
        super().__init__(*args, "--grpc", **kwargs)
        self.cert = ca.read_bytes() if ca else None
        self.client = tuple(p.read_bytes() for p in client) if client else (None, None)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        if self.cert is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(
            self.target, grpc.ssl_channel_credentials(self.cert, *self.client)
        )

    def wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        with self.channel() as channel:
            stub = VllmEngineStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"zserve exited with {self.proc.returncode} before ready:\n{self.log()}"
                    )
                try:
                    if stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).healthy:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"zserve not ready in {self.ready_timeout} s:\n{self.log()}")


def generate(
    stub: VllmEngineStub,
    ids: list[int],
    metadata=(),
    *,
    stream: bool = False,
    request_id: str = "t",
    **params,
) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(**params),
        stream=stream,
    )
    return list(stub.Generate(request, metadata=metadata, timeout=60))


def completes(responses: list[pb.GenerateResponse]) -> list[pb.GenerateComplete]:
    return [r.complete for r in responses if r.WhichOneof("response") == "complete"]


def chunks(responses: list[pb.GenerateResponse]) -> list[pb.GenerateStreamChunk]:
    return [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]


def request_counts(server: ZServe) -> dict[str, float]:
    """`<prefix>:request_success` by finished_reason, summed over every API server, from
    the metrics files /metrics would render (the gRPC door has no HTTP route)."""
    pattern = os.path.join(tempfile.gettempdir(), f"zserve-{server.proc.pid}-*", "metrics")
    folders = glob.glob(pattern)
    assert len(folders) == 1, pattern
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folders[0])
    counts: dict[str, float] = {}
    for family in registry.collect():
        if family.name.endswith("request_success"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    reason = sample.labels["finished_reason"]
                    counts[reason] = counts.get(reason, 0) + sample.value
    return counts


def api_server_pids(server: ZServe) -> list[int]:
    pids = []
    for pid in server.pids():
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("zserve-api"):
            pids.append(pid)
    return pids
