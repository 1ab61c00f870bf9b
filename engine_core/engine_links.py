"""An engine's sockets to the head: the handshake (HELLO → PLAN, later READY) and the
links to every API server. An engine never binds: each socket is a CURVE client that
pins the server's public key (make_socket), so it needs no ZAP handler of its own."""

from __future__ import annotations

import os
import socket
import threading
import time

import zmq

from engine_core.config import EngineProcConfig
from protocol.handshake import EngineHello, EnginePlan, decode_handshake, encode_handshake
from protocol.messages import PROTOCOL_VERSION, EngineReady
from protocol.sockets import make_socket, needs_curve, rank_identity


def open_handshake(ctx: zmq.Context, cfg: EngineProcConfig, rank: int) -> zmq.Socket:
    """Connect to the head's handshake address and say HELLO. A DEALER connecting to
    an address nobody binds yet simply waits, so an engine started before its head
    waits for it."""
    address = cfg.handshake_address
    sock = make_socket(
        ctx,
        zmq.DEALER,
        curve=cfg.curve if needs_curve(address) else None,
        identity=rank_identity(rank),
    )
    sock.connect(address)
    hello = EngineHello(
        PROTOCOL_VERSION, rank, cfg.local, cfg.headless, os.getpid(), socket.gethostname()
    )
    sock.send(encode_handshake("hello", hello))
    return sock


def await_plan(
    sock: zmq.Socket, cfg: EngineProcConfig, rank: int, stop: threading.Event
) -> EnginePlan | None:
    """The head's PLAN (None: asked to stop first); raises if refused or too late."""
    deadline = time.monotonic() + cfg.ready_timeout_s
    while not stop.is_set():
        if sock.poll(200):
            kind, body = decode_handshake(sock.recv())
            if kind != "plan":
                raise RuntimeError(f"handshake: expected a plan, got {kind!r}")
            if body.error:
                raise RuntimeError(f"the head refused engine {rank}: {body.error}")
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"engine {rank}: no answer from the head at {cfg.handshake_address} within "
                f"{cfg.ready_timeout_s:.0f} s (--engine-ready-timeout)"
            )
    return None


def connect_links(
    ctx: zmq.Context, cfg: EngineProcConfig, rank: int, plan: EnginePlan
) -> tuple[list[zmq.Socket], list[zmq.Socket]]:
    """A DEALER to each API server's input address, a PUSH to each output address."""
    inputs, outputs = [], []
    for address in plan.input_addresses:
        sock = make_socket(
            ctx,
            zmq.DEALER,
            curve=cfg.curve if needs_curve(address) else None,
            identity=rank_identity(rank),
        )
        sock.connect(address)
        inputs.append(sock)
    for address in plan.output_addresses:
        sock = make_socket(
            ctx, zmq.PUSH, curve=cfg.curve if needs_curve(address) else None, linger_ms=2000
        )
        sock.connect(address)
        outputs.append(sock)
    return inputs, outputs


def ready_announcement(engine, cfg: EngineProcConfig) -> EngineReady:
    """READY, as the supervisor and every API server hear it, of a loaded EngineCore."""
    return EngineReady(
        protocol_version=PROTOCOL_VERSION,
        rank=cfg.rank,
        max_model_len=engine.max_model_len,
        num_kv_blocks=engine.num_kv_blocks,
        block_size=engine.block_size,
        dtype=engine.dtype,
        device=engine.device,
        vocab_size=engine.vocab_size,
        pid=os.getpid(),
        hostname=socket.gethostname(),
        max_request_tokens=engine.max_request_tokens,
        eos_token_ids=sorted(engine.eos_token_ids),
        architecture=engine.architecture,
        model_type=engine.model_type,
        bos_token_id=engine.bos_token_id,
        pad_token_id=engine.pad_token_id,
        incarnation=cfg.incarnation,
        node_id=cfg.node_id,
        max_beam_width=engine.max_beam_width,
        hidden_size=engine.hidden_size,
    )
