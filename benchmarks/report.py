"""A run's metrics as a terminal report and as a JSON result (vllm bench serve's keys)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.client import RequestResult
from benchmarks.stats import Metrics, Timeline, output_tokens, tpot

_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
_WIDTH = 50


def percentile_key(p: float) -> str:
    """99 → "p99", 99.9 → "p99.9" (the JSON key stem)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40}{value:>10}"


def format_report(
    metrics: Metrics,
    *,
    title: str,
    max_concurrency: int | None,
    request_rate: float,
    shown_metrics: Sequence[str],
) -> str:
    m = metrics
    lines = [
        f" {title} ".center(_WIDTH, "="),
        _line("Successful requests:", m.completed),
        _line("Failed requests:", m.failed),
        _line("Maximum request concurrency:", max_concurrency or "none"),
        _line("Request rate (req/s):", "inf" if math.isinf(request_rate) else request_rate),
        _line("Benchmark duration (s):", m.duration),
        _line("Total input tokens:", m.total_input_tokens),
        _line("Total generated tokens:", m.total_output_tokens),
        _line("Request throughput (req/s):", m.request_throughput),
    ]
    if m.request_goodput is not None:
        lines.append(_line("Request goodput (req/s):", m.request_goodput))
    lines += [
        _line("Output token throughput (tok/s):", m.output_throughput),
        _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
        _line("Peak concurrent requests:", m.max_concurrent_requests),
        _line("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    for name in shown_metrics:
        d = m.distribution(name)
        short = name.upper()
        lines.append(f" {_TITLES[name]} ".center(_WIDTH, "-"))
        lines.append(_line(f"Mean {short} (ms):", d.mean))
        lines.append(_line(f"Median {short} (ms):", d.median))
        lines.append(_line(f"Std {short} (ms):", d.std))
        for p, value in d.percentiles.items():
            lines.append(_line(f"P{percentile_key(p)[1:]} {short} (ms):", value))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def metrics_json(metrics: Metrics) -> dict[str, Any]:
    """The aggregate fields, flat, named as vllm bench serve names them."""
    m = metrics
    out: dict[str, Any] = {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        d = m.distribution(name)
        out[f"mean_{name}_ms"] = d.mean
        out[f"median_{name}_ms"] = d.median
        out[f"std_{name}_ms"] = d.std
        for p, value in d.percentiles.items():
            out[f"{percentile_key(p)}_{name}_ms"] = value
    return out


def requests_json(results: Sequence[RequestResult], *, texts: bool) -> dict[str, Any]:
    """Per-request arrays, in dispatch order (times in seconds)."""
    out: dict[str, Any] = {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [output_tokens(r) for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [tpot(r) for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "errors": [r.error for r in results],
    }
    if texts:
        out["generated_texts"] = [r.generated_text for r in results]
    return out


def timeline_json(tl: Timeline) -> dict[str, Any]:
    return {
        "timeline_bucket_s": tl.bucket_s,
        "timeline_output_tokens_per_s": tl.tokens_per_s,
        "timeline_in_flight": tl.in_flight,
    }
