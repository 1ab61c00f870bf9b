"""Serving metrics from per-request results, defined as `vllm bench serve` defines them.

- TTFT: request start → first chunk with generated text.
- TPOT: (e2e latency − TTFT) / (output tokens − 1), over requests with more than one token.
- ITL: every gap between consecutive generated chunks, of all requests pooled.
- E2EL: request start → last generated chunk.
- Throughputs divide by the run's wall time; goodput counts completed requests that meet
  every SLO given (a one-token request's TPOT is 0).
Percentiles interpolate linearly between closest ranks (numpy's default method).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from benchmarks.client import RequestResult
from benchmarks.tokenizer import BenchTokenizer

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0–100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Iterable[float]) -> Distribution:
        ms = [s * 1000.0 for s in seconds]
        return cls(
            mean=statistics.fmean(ms) if ms else 0.0,
            median=statistics.median(ms) if ms else 0.0,
            std=statistics.pstdev(ms) if ms else 0.0,
            percentiles={p: percentile(ms, p) for p in percentiles},
        )


@dataclass(frozen=True)
class Metrics:
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution

    def distribution(self, metric: str) -> Distribution:
        return getattr(self, metric)


def output_tokens(result: RequestResult) -> int:
    return (result.output_tokens or 0) if result.success else 0


def tpot(result: RequestResult) -> float:
    """Seconds per output token after the first; 0 for a request of one token or less."""
    n = output_tokens(result)
    return (result.latency - result.ttft) / (n - 1) if n > 1 else 0.0


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` → {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in SLO_METRICS or ms < 0:
            raise ValueError(
                f"bad --goodput {item!r}: expected NAME:MS with NAME one of "
                f"{', '.join(SLO_METRICS)} and MS >= 0"
            )
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (ms)."""
    measured = {"ttft": result.ttft, "tpot": tpot(result), "e2el": result.latency}
    return result.success and all(measured[k] * 1000.0 <= ms for k, ms in slos.items())


def count_missing_output_tokens(results: Sequence[RequestResult], tok: BenchTokenizer) -> int:
    """Re-tokenize the text of completed requests whose server sent no usage; how many."""
    missing = [r for r in results if r.success and r.output_tokens is None]
    for r in missing:
        r.output_tokens = tok.count(r.generated_text)
    return len(missing)


def chunk_times(result: RequestResult) -> list[float]:
    """Arrival times (s since the run's start) of a completed request's generated chunks."""
    t = result.start_time + result.ttft
    times = [t]
    for gap in result.itl:
        t += gap
        times.append(t)
    return times


@dataclass(frozen=True)
class Timeline:
    """Output tokens/s and mean requests in flight, per time bucket of the run."""

    bucket_s: float
    tokens_per_s: list[float]
    in_flight: list[float]


def timeline(results: Sequence[RequestResult], bucket_s: float = 1.0) -> Timeline:
    """Bucketed throughput; a chunk counts its request's tokens spread evenly over chunks."""
    done = [r for r in results if r.success]
    end = max((r.start_time + r.latency for r in done), default=0.0)
    n = max(1, math.ceil(end / bucket_s))
    tokens = [0.0] * n
    busy = [0.0] * n
    for r in done:
        times = chunk_times(r)
        per_chunk = output_tokens(r) / len(times)
        for t in times:
            tokens[min(int(t / bucket_s), n - 1)] += per_chunk
        start, stop = r.start_time, r.start_time + r.latency
        for b in range(int(start / bucket_s), min(int(stop / bucket_s), n - 1) + 1):
            lo, hi = b * bucket_s, (b + 1) * bucket_s
            busy[b] += max(0.0, min(stop, hi) - max(start, lo))
    return Timeline(bucket_s, [x / bucket_s for x in tokens], [x / bucket_s for x in busy])


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most completed requests in flight at one instant (client side)."""
    events = []
    for r in results:
        if r.success:
            events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    peak = level = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        level += step
        peak = max(peak, level)
    return peak


def _peak_tokens_per_s(done: Sequence[RequestResult]) -> float:
    """Best 1-second bucket (the whole run when it lasted less than a second)."""
    end = max((r.start_time + r.latency for r in done), default=0.0)
    return max(timeline(done, min(1.0, end)).tokens_per_s) if end > 0 else 0.0


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (50, 90, 99),
    slos: dict[str, float] | None = None,
) -> Metrics:
    """Aggregate a run. Output tokens must be counted (see count_missing_output_tokens)."""
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(output_tokens(r) for r in done)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return Metrics(
        completed=len(done),
        failed=len(results) - len(done),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) * per_s,
        request_goodput=sum(meets_slos(r, slos) for r in done) * per_s if slos else None,
        output_throughput=total_out * per_s,
        total_token_throughput=(total_in + total_out) * per_s,
        max_output_tokens_per_s=_peak_tokens_per_s(done),
        max_concurrent_requests=peak_concurrency(done),
        ttft=Distribution.of([r.ttft for r in done], percentiles),
        tpot=Distribution.of([tpot(r) for r in done if output_tokens(r) > 1], percentiles),
        itl=Distribution.of([gap for r in done for gap in r.itl], percentiles),
        e2el=Distribution.of([r.latency for r in done], percentiles),
    )
