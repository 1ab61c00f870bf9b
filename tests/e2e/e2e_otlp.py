"""An OpenTelemetry collector for the e2e tests: a real OTLP/gRPC TraceService on a free
port that keeps every span it is sent (opentelemetry-proto's service, grpcio's server)."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str  # hex
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    resource: dict


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OTLPCollector) -> None:
        self.collector = collector

    def Export(self, request, context):  # noqa: N802 (the proto's name)
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.collector.add(
                        ReceivedSpan(
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            resource=resource,
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPCollector:
    """Use as a context manager; `endpoint` is what --otlp-traces-endpoint takes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, span: ReceivedSpan) -> None:
        with self.lock:
            self.spans.append(span)

    def with_attribute(self, key: str, value) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.attributes.get(key) == value]

    def __enter__(self) -> OTLPCollector:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(0)
