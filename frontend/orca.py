"""ORCA endpoint load reports: a request that sends `endpoint-load-metrics-format`
(`text` or `json`) gets the server's load in an `endpoint-load-metrics` response
header, as vLLM's completions and chat answers carry it (load balancers such as
Envoy read it)."""

from __future__ import annotations

import json
from collections.abc import Iterable

from frontend.engine_state import EngineState

REQUEST_HEADER = "endpoint-load-metrics-format"
RESPONSE_HEADER = "endpoint-load-metrics"


def load_report(fmt: str, engines: Iterable[EngineState]) -> dict[str, str]:
    """The header for format `fmt` (any case); none for another format, as in vLLM.
    Requests waiting are summed over the engines, KV cache usage is their mean."""
    fmt = fmt.lower()
    if fmt not in ("text", "json"):
        return {}
    stats = [e.stats for e in engines]
    metrics = {
        "num_requests_waiting": float(sum(s.num_waiting for s in stats)),
        "kv_cache_usage_perc": sum(s.kv_cache_usage for s in stats) / max(len(stats), 1),
    }
    if fmt == "text":
        value = "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in metrics.items())
    else:
        value = "JSON " + json.dumps({"named_metrics": metrics})
    return {RESPONSE_HEADER: value}
