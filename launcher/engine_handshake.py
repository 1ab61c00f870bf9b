"""The head's side of the engine handshake (DESIGN.md §3): every engine, local or on
another node, says HELLO; the head answers with the plan (every API server's
endpoints) or a refusal; the engine loads its model and says READY."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from launcher.children import StartupError
from launcher.plan import Topology
from protocol.handshake import (
    EngineHello,
    EnginePlan,
    ProtocolVersionError,
    decode_handshake,
    encode_handshake,
)
from protocol.messages import PROTOCOL_VERSION, LoraConfig
from protocol.sockets import CurveKeys, bind, identity_rank, make_socket, needs_curve

log = logging.getLogger("zserve.supervisor")


class EngineHandshake:
    """The ROUTER socket engines say HELLO and READY on, bound for the server's life."""

    def __init__(
        self, ctx: zmq.Context, address: str, keys: CurveKeys | None, topology: Topology
    ) -> None:
        self.address = address
        self.topology = topology
        self.socket = make_socket(
            ctx, zmq.ROUTER, curve=keys if needs_curve(address) else None, curve_server=True
        )
        # A restarted engine says HELLO with its rank's identity again (engine_restarts.py).
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self.address = bind(self.socket, address)  # port 0 → the port bound
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            raise StartupError(f"cannot bind the engine handshake socket {address}: {e}") from e

    def run(self, plan: EnginePlan, timeout_s: float, check: Callable[[], None]) -> None:
        """HELLO → PLAN for every rank, then wait for every READY; `check` raises if a
        child died meanwhile."""
        expected = set(range(self.topology.data_parallel_size))
        ready: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while ready != expected:
            check()
            if time.monotonic() > deadline:
                missing = sorted(expected - ready)
                raise TimeoutError(
                    f"engine(s) {missing} not ready within {timeout_s:.0f} s "
                    f"(--engine-ready-timeout); remote engines join at {self.address}"
                )
            if self.socket.poll(200):
                rank = self._receive(plan, {rank: 0 for rank in expected - ready})
                if rank is not None:
                    ready.add(rank)

    def rejoin(self, plan: EnginePlan, pending: dict[int, int]) -> list[int]:
        """Without waiting: answer the restarted engines' HELLOs, and return the ranks
        of `pending` (rank → the incarnation started) whose READY came."""
        back = []
        while self.socket.poll(0):
            rank = self._receive(plan, pending)
            if rank is not None:
                back.append(rank)
        return back

    def _receive(self, plan: EnginePlan, expected: dict[int, int]) -> int | None:
        """One message; the rank, if it was the READY of an expected incarnation."""
        identity, data = self.socket.recv_multipart()
        rank = identity_rank(identity)
        try:
            kind, body = decode_handshake(data)
        except ProtocolVersionError as e:
            self.socket.send_multipart([identity, encode_handshake("plan", _refusal(str(e)))])
            raise ProtocolVersionError(f"engine {rank}: {e}") from None
        except ValueError as e:
            log.warning("dropped a malformed handshake message from %r: %s", identity, e)
            return None
        if kind == "hello":
            self._on_hello(identity, rank, body, set(expected), plan)
        elif kind == "ready" and expected.get(rank) == body.incarnation:
            log.info(
                "engine %d ready (pid %d on %s%s, %s, %d KV blocks)",
                rank,
                body.pid,
                body.hostname,
                f", Ray node {body.node_id}" if body.node_id else "",
                body.device,
                body.num_kv_blocks,
            )
            return rank
        return None

    def _on_hello(
        self, identity: bytes, rank: int, hello: EngineHello, expected: set[int], plan: EnginePlan
    ) -> None:
        local_ranks = self.topology.local_ranks
        problem = None
        if rank not in expected or hello.rank != rank:
            problem = f"rank {rank} is not expected here now (expected: ranks {sorted(expected)})"
        elif (rank in local_ranks) == hello.headless:
            problem = (
                f"rank {rank} is {'local' if rank in local_ranks else 'remote'} here but the "
                f"engine says headless={hello.headless}"
            )
        if problem:
            log.warning("refused engine %d: %s", rank, problem)
            self.socket.send_multipart([identity, encode_handshake("plan", _refusal(problem))])
            return
        log.info("engine %d said hello (pid %d on %s)", rank, hello.pid, hello.hostname)
        self.socket.send_multipart([identity, encode_handshake("plan", plan)])

    def close(self) -> None:
        self.socket.close(linger=0)


def engine_plan(
    inputs: list[str], outputs: list[str], lora: LoraConfig | None = None
) -> EnginePlan:
    """What every accepted engine hears: the API servers' endpoints, in index order, and
    the server's LoRA settings."""
    return EnginePlan(PROTOCOL_VERSION, inputs, outputs, lora=lora)


def _refusal(reason: str) -> EnginePlan:
    return EnginePlan(PROTOCOL_VERSION, [], [], error=reason)
