"""An API server takes a restarted engine back (issue 20): a higher incarnation
re-joins, a stale one or a stale death report changes nothing, the same incarnation
re-announcing after its death stays dead (frontend/engine_client.py)."""

from __future__ import annotations

import asyncio

import pytest

from frontend.engine_client import EngineClient
from frontend.engine_state import ClientConfig, EngineDeadError, RequestStream
from protocol import codec
from protocol.messages import (
    PROTOCOL_VERSION,
    EngineCoreRequest,
    EngineReady,
    SamplingParams,
    SchedulerStats,
)
from protocol.sockets import ipc_address, rank_identity


def ready(rank: int, incarnation: int, pid: int = 100) -> EngineReady:
    return EngineReady(
        PROTOCOL_VERSION, rank, 64, 8, 16, "float32", "cpu", pid=pid, incarnation=incarnation
    )


def announce(client: EngineClient, msg: EngineReady, pending: set[int] | None = None) -> None:
    client._on_router_message([rank_identity(msg.rank), codec.encode(msg)], pending)


@pytest.fixture
def client(tmp_path):
    c = EngineClient(
        ClientConfig(0, 2, ipc_address(str(tmp_path), "in"), ipc_address(str(tmp_path), "out"))
    )
    pending = {0, 1}
    for rank in (0, 1):
        announce(c, ready(rank, 0), pending)
    assert not pending
    yield c
    c.close()


def in_flight(client: EngineClient, rank: int, request_id: str) -> RequestStream:
    stream = RequestStream(request_id, client.engines[rank])
    client.requests[request_id] = stream
    client.engines[rank].in_flight += 1
    return stream


def test_a_dead_engine_re_joins_with_its_next_incarnation(client):
    engine = client.engines[1]
    engine.stats = SchedulerStats(num_running=7)
    stream = in_flight(client, 1, "r1")
    client.engine_died(1, "its actor died", incarnation=0)
    assert not engine.alive and isinstance(stream.error, EngineDeadError)
    announce(client, ready(1, 0))  # the dead incarnation again: stays dead
    assert not engine.alive
    announce(client, ready(1, 1, pid=200))
    assert engine.alive and engine.ready.pid == 200 and engine.ready.incarnation == 1
    assert engine.stats.num_running == 0 and engine.in_flight == 0
    assert client.pick_engine(1) is engine


def test_a_restart_seen_before_the_death_fails_the_earlier_incarnations_requests(client):
    stream = in_flight(client, 0, "r0")
    other = in_flight(client, 1, "r1")
    announce(client, ready(0, 1))
    assert "engine 0 restarted" in str(stream.error)
    assert other.error is None and "r1" in client.requests and "r0" not in client.requests
    assert client.engines[0].alive and client.engines[0].in_flight == 0


def test_stale_announcements_and_death_reports_change_nothing(client):
    announce(client, ready(0, 2))
    client.engine_died(0, "about incarnation 1", incarnation=1)
    announce(client, ready(0, 1))
    assert client.engines[0].alive and client.engines[0].ready.incarnation == 2
    client.engine_died(0, "about now", incarnation=-1)
    assert not client.engines[0].alive


def test_the_server_is_alive_again_once_any_engine_is_back(client):
    for rank in (0, 1):
        client.engine_died(rank, "gone", incarnation=0)
    assert client.dead
    announce(client, ready(1, 1))
    assert not client.dead and client.pick_engine() is client.engines[1]


def test_a_send_to_an_engine_that_is_not_connected_marks_it_dead(client):
    """ROUTER_MANDATORY: a message for an identity with no connection fails at once
    (EHOSTUNREACH). The engine is then dead for this API server, an ADD says so to its
    caller, and an abort (a cleanup) does not raise."""

    async def sends() -> None:  # on the API server's loop, as zmq.asyncio's sends run
        stream = in_flight(client, 1, "r1")
        client.abort(["r1"])
        assert not client.engines[1].alive
        assert "cannot reach engine 1" in client.engines[1].dead_reason
        assert stream.finished
        request = EngineCoreRequest("r0", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=0.0)
        with pytest.raises(EngineDeadError, match="cannot reach engine 0"):
            client.add_request(request, client.engines[0])
        assert not client.engines[0].alive
        assert client.dead

    asyncio.run(sends())
