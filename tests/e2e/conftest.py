"""The e2e suite's default server: one `zserve serve` on the tiny llama, shared by every
module of this folder that asks for it (server start-ups are the suite's main cost)."""

from __future__ import annotations

import pytest
from e2e_http import SERVED_NAMES, SMALL_KV, http_client, sync_client
from zserve_proc import ZServe


@pytest.fixture(scope="package")
def default_server(tiny_model):
    """Default flags, two served names, the development routes (for /server_info) and
    the scale-out routes; no test may leave it in a changed state (none puts it to
    sleep)."""
    flags = ("--enable-dev-routes", "--enable-scale-out")
    with ZServe(str(tiny_model("llama")), *SERVED_NAMES, *SMALL_KV, *flags) as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="package")
def client(default_server):
    with sync_client(default_server) as c:
        yield c


@pytest.fixture(scope="package")
def http(default_server):
    with http_client(default_server) as c:
        yield c


# Tool calling and structured outputs (test_structured_outputs.py, test_tool_calling.py,
# test_agent_frameworks.py): compact JSON keeps a random model's documents short.
TOOLS_FLAGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--structured-outputs-config",
    "disable_any_whitespace=true",
)


@pytest.fixture(scope="package")
def tools_server(tiny_model):
    with ZServe(str(tiny_model("llama")), *SERVED_NAMES, *SMALL_KV, *TOOLS_FLAGS) as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="package")
def tools_client(tools_server):
    with sync_client(tools_server) as c:
        yield c


@pytest.fixture(scope="package")
def tools_http(tools_server):
    with http_client(tools_server) as c:
        yield c
