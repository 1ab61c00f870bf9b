"""The gRPC API-server process (`zserve serve --grpc`): the VllmEngine service
(grpc_service.py) on grpcio's asyncio server, on this process's own SO_REUSEPORT
listener of the shared port, as the HTTP door does (the process around it is
api_process.py)."""

from __future__ import annotations

import asyncio
import inspect
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from frontend.api_key import bearer_matches
from frontend.api_process import APIProcess, run_api_process
from frontend.config import APIServerConfig, FrontendConfig
from frontend.grpc_service import EngineService
from protocol.sockets import is_ipv6

SERVICE = f"/{pb.DESCRIPTOR.services_by_name['VllmEngine'].full_name}/"
# Answered without the API key, as GET /health is: a probe learns only health.
OPEN_METHODS = frozenset({SERVICE + "HealthCheck"})
UNAUTHORIZED = "Unauthorized: send the API key as metadata 'authorization: Bearer <key>'"


def server_options(fc: FrontendConfig) -> list[tuple[str, int]]:
    """What one client may send, from the hardening limits; and HTTP/2 pings kept
    welcome, since gateways keep their channels alive with them."""
    limits = fc.limits
    return [
        ("grpc.so_reuseport", 1),
        ("grpc.max_receive_message_length", limits.max_body_bytes),
        ("grpc.max_metadata_size", limits.max_header_bytes),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        # A connection must finish its HTTP/2 (and TLS) handshake as fast as an HTTP
        # client must send its headers.
        ("grpc.server_handshake_timeout_ms", int(limits.header_timeout_s * 1000) or 120_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]


def listen_address(host: str | None, port: int) -> str:
    host = (host or "0.0.0.0").strip("[]")
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every method but OPEN_METHODS needs `authorization: Bearer <key>` (api_key.py)."""

    def __init__(self, api_key: str) -> None:
        self.expected = api_key.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method in OPEN_METHODS:
            return await continuation(details)
        given = next(
            (v for k, v in details.invocation_metadata or () if k == "authorization"), None
        )
        if bearer_matches(given, self.expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_refuse_stream)
        return grpc.unary_unary_rpc_method_handler(_refuse)


async def _refuse(request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)


async def _refuse_stream(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)
    yield  # pragma: no cover - makes this an async generator, as the handler kind wants


def service_handler(service: EngineService) -> grpc.GenericRpcHandler:
    """The VllmEngine methods, each parsing its own request: bytes that are no message
    of the method's type are an INVALID_ARGUMENT, not an exception in grpcio's log."""
    descriptor = pb.DESCRIPTOR.services_by_name["VllmEngine"]
    handlers = {}
    for method in descriptor.methods:
        behavior = getattr(service, method.name)
        request_type = GetMessageClass(method.input_type)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(behavior, request_type), response_serializer=_serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(behavior, request_type), response_serializer=_serialize
            )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


def _serialize(message) -> bytes:
    return message.SerializeToString()


async def _parse(data: bytes, request_type, context: grpc.aio.ServicerContext):
    try:
        return request_type.FromString(data)
    except DecodeError:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid {request_type.DESCRIPTOR.full_name} message",
        )


def _unary(behavior, request_type):
    async def handle(data: bytes, context: grpc.aio.ServicerContext):
        return await behavior(await _parse(data, request_type, context), context)

    return handle


def _streaming(behavior, request_type):
    async def handle(data: bytes, context: grpc.aio.ServicerContext):
        responses = behavior(await _parse(data, request_type, context), context)
        if inspect.isawaitable(responses):  # an RPC that only ever refuses
            await responses
            return
        async for response in responses:
            yield response

    return handle


class GRPCServer(APIProcess):
    """smg-grpc-proto's VllmEngine service, for model gateways."""

    door = "gRPC"

    def __init__(self, cfg: APIServerConfig, pipe: Connection | None) -> None:
        super().__init__(cfg, pipe)
        self.server: grpc.aio.Server | None = None
        self.stopping: asyncio.Task | None = None

    async def open_door(self) -> None:
        fc = self.cfg.frontend
        interceptors = [APIKeyInterceptor(fc.api_key)] if fc.api_key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(fc))
        self.server.add_generic_rpc_handlers((service_handler(EngineService(self.ctx)),))
        address = listen_address(fc.host, fc.port)
        if fc.ssl_certfile:
            credentials = grpc.ssl_server_credentials(
                [(Path(fc.ssl_keyfile).read_bytes(), Path(fc.ssl_certfile).read_bytes())],
                root_certificates=Path(fc.ssl_ca_certs).read_bytes() if fc.ssl_ca_certs else None,
                require_client_auth=fc.ssl_cert_reqs == 2,  # ssl.CERT_REQUIRED
            )
            bound = self.server.add_secure_port(address, credentials)
        else:
            bound = self.server.add_insecure_port(address)
        if bound != fc.port:
            raise RuntimeError(f"gRPC could not listen on {address}")
        await self.server.start()

    async def serve_door(self) -> None:
        await self.server.wait_for_termination()

    def stop_door(self) -> None:
        if self.server is not None and self.stopping is None:
            self.stopping = asyncio.get_running_loop().create_task(self.server.stop(1.0))


def run_grpc_server(cfg: APIServerConfig, pipe: Connection | None = None) -> None:
    """Process entry point of one gRPC API server."""
    run_api_process(cfg, pipe, GRPCServer)
