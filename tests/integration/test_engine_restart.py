"""--engine-restart-policy on-failure with engines on this node: a killed engine
process is started again and re-joins the running API servers (issue 20)."""

from __future__ import annotations

import os
import signal

import pytest
from engine_rejoin import engines_served, kill_mid_stream_and_rejoin
from test_failures import MODEL, SMALL_KV
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(240)


def test_a_killed_engine_process_restarts_and_takes_traffic_again(small_model):
    server = ZServe(
        str(small_model),
        "--served-model-name",
        MODEL,
        *SMALL_KV,
        "--data-parallel-size",
        "2",
        "--engine-restart-policy",
        "on-failure",
        "--enable-dev-routes",  # /server_info shows each engine's incarnation
    )
    with server:
        before, after = kill_mid_stream_and_rejoin(
            server, 1, lambda e: os.kill(e["pid"], signal.SIGKILL), api_servers=2
        )
        assert engines_served(server.base_url) == {"0", "1"}
        log = server.log()
        assert "restarting it (incarnation 1)" in log and "engine 1 is back" in log
        assert "failing the server" not in log
