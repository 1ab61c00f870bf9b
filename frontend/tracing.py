"""--otlp-traces-endpoint: one OpenTelemetry span per finished request, as vLLM exports
them: named `llm_request`, kind SERVER, from the request's arrival to its end, a child
of the caller's trace when the request carried `traceparent` (W3C trace context), with
vLLM's `gen_ai.*` attributes (the request's sampling parameters, token counts, and its
time in the queue, in prefill, in decode, to the first token and in all).

The spans leave in batches from the SDK's own thread (BatchSpanProcessor: at most 2,048
waiting, the rest dropped), so a slow or absent collector never holds up a request.
The protocol is OTLP over gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says
http/protobuf, as in vLLM; the other OTEL_* variables (OTEL_SERVICE_NAME, the batch
delays, the exporter's headers and timeout) work as the SDK documents them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from frontend.generation import Generation

log = logging.getLogger("zserve.api")

TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOLS = ("grpc", "http/protobuf")
SHUTDOWN_TIMEOUT_MS = 2000  # a stop never waits longer than this for the collector


def tracing_problem(endpoint: str | None) -> str | None:
    """Why --otlp-traces-endpoint cannot work here; None: it can (or is not asked for)."""
    if not endpoint:
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol not in PROTOCOLS:
        return (
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported with "
            f"--otlp-traces-endpoint (use {' or '.join(PROTOCOLS)})"
        )
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        if protocol == "grpc":
            import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        else:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError as e:
        return (
            f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter ({e}); "
            f"install them with: pip install 'zserve[tracing]'"
        )
    return None


class RequestTracer:
    """This API server's tracer provider and the spans it records."""

    def __init__(self, endpoint: str, model_name: str, api_server: int) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create(
            {"zserve.api_server": api_server, "zserve.process_id": os.getpid()}
        )
        self.provider = TracerProvider(resource=resource)
        self.exporter = _exporter(endpoint)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("zserve.frontend")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = SpanKind.SERVER
        self.model_name = model_name

    def record(self, generation: Generation, finished_ns: int) -> None:
        """One span per choice (engine request), as vLLM has one per sequence."""
        parent = None
        if generation.trace_headers:
            parent = self.propagator.extract(generation.trace_headers)
        start_ns = int(generation.arrival_time * 1e9)
        finished_s = finished_ns / 1e9
        for choice in generation.choices:
            span = self.tracer.start_span(
                "llm_request",
                context=parent,
                kind=self.kind,
                attributes=self._attributes(generation, choice, finished_s),
                start_time=start_ns,
            )
            span.end(end_time=finished_ns)

    def _attributes(self, generation: Generation, choice, finished_s: float) -> dict:
        params = choice.params
        arrival = generation.arrival_time
        attributes = {
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.id": generation.request_id,
            "gen_ai.request.n": generation.params_n,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.prompt_tokens": len(choice.prompt_ids),
            "gen_ai.usage.completion_tokens": choice.num_generated,
            "gen_ai.response.finish_reasons": [choice.finish_reason or "abort"],
            "gen_ai.latency.e2e": finished_s - arrival,
        }
        if choice.first_token_time:  # as the metrics split it (frontend/metrics.py)
            ttft = choice.first_token_time - arrival
            queued = min(choice.queue_time_s, ttft)
            attributes.update(
                {
                    "gen_ai.latency.time_to_first_token": ttft,
                    "gen_ai.latency.time_in_queue": queued,
                    "gen_ai.latency.time_in_model_prefill": ttft - queued,
                    "gen_ai.latency.time_in_model_decode": finished_s - choice.first_token_time,
                    "gen_ai.latency.time_in_model_inference": finished_s - arrival - queued,
                }
            )
        return attributes

    def close(self) -> None:
        """Send what is waiting, for at most SHUTDOWN_TIMEOUT_MS: an export still
        retrying against an absent collector then stops (the exporter's shutdown ends
        its back-off) instead of holding up the process's exit."""
        # force_flush exports in the calling thread and outlasts its own timeout while
        # the exporter retries, so it runs in a thread that is waited for this long.
        flush = threading.Thread(target=self.provider.force_flush, daemon=True)
        flush.start()
        flush.join(SHUTDOWN_TIMEOUT_MS / 1000)
        self.exporter.shutdown()
        self.provider.shutdown()


def _exporter(endpoint: str):
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # Plain gRPC (vLLM always uses it) unless the URL says https.
        return OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def trace_headers(headers) -> dict[str, str] | None:
    """The W3C trace context of a request's headers, if it carries one."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None
