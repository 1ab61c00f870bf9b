"""`zserve bench ipc`: real ZMQ between two processes, every transport, both directions."""

from __future__ import annotations

import pytest

from benchmarks.ipc import TRANSPORTS, Case, measure

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_outputs_and_requests_cross_each_transport_and_are_measured(transport, tmp_path):
    for case in (Case(outputs=64), Case(prompt_len=2048)):
        row = measure(transport, case, count=50, tmpdir=str(tmp_path))
        assert row.transport == transport and row.messages == 50
        assert row.bytes_per_message > (64 * 30 if case.outputs else 2048)
        assert row.us_per_message > 0 and row.mb_per_s > 0
        assert (row.us_per_output is not None) == bool(case.outputs)


def test_case_messages_decode_to_what_was_encoded():
    batch = Case(outputs=512)
    assert batch.decode(batch.frames(batch.message())) == 512
    request = Case(prompt_len=8192)
    assert request.decode(request.frames(request.message())) == 8192
