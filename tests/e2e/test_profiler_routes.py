"""Issue 18 §3: --profiler-config runs torch's profiler in every engine between POST
/start_profile and /stop_profile, one Chrome/Perfetto trace per engine, named for its
rank. This server has no --enable-dev-routes: those routes (and /server_info) are 404."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
import pytest
from e2e_http import MODEL, SERVED_NAMES, assert_error
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(180)

KEY = "sk-profiler"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def server(tiny_model, traces):
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(traces),
        "torch_profiler_record_shapes": True,
        "torch_profiler_with_stack": False,
    }
    with ZServe(
        str(tiny_model("llama")),
        *SERVED_NAMES,
        "--kv-cache-memory-bytes", "32MiB",
        "--device", "cpu",
        "--data-parallel-size", "2",
        "--api-server-count", "1",
        "--tokenizer-pool-size", "0",
        "--api-key", KEY,
        "--profiler-config", json.dumps(config),
    ) as s:  # fmt: skip
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]
    assert "the profiler routes are on (--profiler-config)" in log


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/collective_rpc"),
        ("GET", "/server_info"),
    ],
)
def test_the_dev_routes_are_absent_without_their_flag(http, method, path):
    assert_error(http.request(method, path, json={"method": "ping"}), 404)
    assert path not in http.get("/openapi.json").json()["paths"]


def test_the_profiler_routes_need_the_api_key(server):
    for path in ("/start_profile", "/stop_profile"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert_error(httpx.post(server.base_url + path, headers=headers, timeout=30), 401)


def test_stopping_a_profiler_never_started_is_a_conflict(http):
    error = assert_error(http.post("/stop_profile"), 409, contains=["not running"])
    assert "engine 0" in error["message"] and "engine 1" in error["message"]


def test_a_profile_writes_one_trace_per_engine_named_for_its_rank(http, traces):
    r = http.post("/start_profile")
    assert r.status_code == 200, r.text
    assert [e["rank"] for e in r.json()["engines"]] == [0, 1]
    assert_error(http.post("/start_profile"), 409, contains=["already running"])
    for rank in ("0", "1"):  # work on each engine, so each trace has steps in it
        r = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "profile me", "max_tokens": 4},
            headers={"X-data-parallel-rank": rank},
        )
        assert r.status_code == 200
    r = http.post("/stop_profile")
    assert r.status_code == 200, r.text
    written = [Path(e["trace"]) for e in r.json()["engines"]]
    assert sorted(p.name.split(".")[0] for p in written) == [
        "zserve-engine-rank0",
        "zserve-engine-rank1",
    ]
    assert sorted(traces.iterdir()) == sorted(written)
    for path in written:
        assert path.name.endswith(".pt.trace.json.gz")  # vLLM's default: gzip
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        steps = [e for e in events if e.get("name") == "zserve.engine_step"]
        assert len(steps) >= 4  # one range per engine step: prefill and three decodes
        assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes
    assert_error(http.post("/stop_profile"), 409)
