"""Prometheus metrics with vLLM's names and meanings, under `--metrics-prefix` (zserve).

Request metrics are counted by the API server that served the request, in
prometheus_client's multiprocess mode (the supervisor creates the directory and sets
PROMETHEUS_MULTIPROC_DIR before spawning), so `/metrics` on any API server sums them
over all of them. Engine metrics come from the latest stats every engine reported to
*this* API server (every engine reports to every API server at least once a second),
labelled by engine; the engine's counters are cumulative, so no API server needs to
have seen every step.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.multiprocess import MultiProcessCollector

from frontend.engine_client import EngineClient
from frontend.generation import Choice, Generation
from protocol.messages import ITERATION_TOKEN_BUCKETS, REQUEST_PREEMPTION_BUCKETS

# Why a request was refused at admission (--max-num-queued-reqs / -tokens): vLLM's labels.
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (seconds).
# fmt: off
_LATENCY = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0]
_REQUEST_TIME = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# fmt: on


def _token_buckets(max_model_len: int) -> list[float]:
    buckets, base = [], 1
    while True:
        for m in (1, 2, 5):
            value = m * base
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        base *= 10


class Metrics:
    """Request metrics (counted here) and engine metrics (read from the client)."""

    def __init__(self, prefix: str, model_name: str, client: EngineClient, max_model_len: int):
        p = prefix + ":"
        self.model_name = model_name
        self.client = client
        self.prefix = p
        labels = ["model_name"]
        self.registry = CollectorRegistry()
        # Multiprocess mode: values live in mmap files that the collector sums.
        multiprocess = multiprocess_dir() is not None
        registry = None if multiprocess else self.registry

        # The request metrics' attributes are this model's series: labelled once here
        # (each exists from the start, at zero, as dashboards expect), not on every
        # observation.
        def histogram(name, doc, buckets):
            family = Histogram(p + name, doc, labels, buckets=buckets, registry=registry)
            return family.labels(model_name)

        def counter(name, doc):
            return Counter(p + name, doc, labels, registry=registry).labels(model_name)

        tokens = _token_buckets(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token of a request.",
            _ITL,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end latency.", _REQUEST_TIME)
        self.queue = histogram(
            "request_queue_time_seconds", "Time waiting in the engine queue.", _REQUEST_TIME
        )
        self.inference = histogram(
            "request_inference_time_seconds",
            "Time from first scheduled to finished.",
            _REQUEST_TIME,
        )
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Time from first scheduled to first token.",
            _REQUEST_TIME,
        )
        self.decode = histogram(
            "request_decode_time_seconds", "Time from first token to finished.", _REQUEST_TIME
        )
        self.prompt_tokens_hist = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", tokens
        )
        self.generation_tokens_hist = histogram(
            "request_generation_tokens", "Generated tokens per request.", tokens
        )
        self.max_tokens_param = histogram(
            "request_params_max_tokens", "max_tokens per request.", tokens
        )
        self.max_generation = histogram(
            "request_max_num_generation_tokens",
            "The most tokens any sequence of a request generated.",
            tokens,
        )
        self.n_param = histogram("request_params_n", "n per request.", [1, 2, 5, 10, 20])
        self._gaps: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success_by_reason = Counter(
            p + "request_success",
            "Finished requests.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self.success = {
            reason: self.success_by_reason.labels(model_name, reason)
            for reason in ("stop", "length", "abort", "error")
        }
        self.admission_rejections = Counter(
            p + "admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            [*labels, "reason"],
            registry=registry,
        )
        self.api_server_restarts = Counter(
            p + "api_server_restarts",
            "API-server processes restarted by the supervisor.",
            registry=registry,
        )
        # One series per API server (each writes only its own label); "live": a
        # restarted server's old process no longer counts.
        self.loop_lag = Gauge(
            p + "api_server_event_loop_lag_seconds",
            "How late the API server's event loop last woke up: the time it spent blocked.",
            ["api_server"],
            registry=registry,
            multiprocess_mode="livesum",
        ).labels(str(client.client_index))
        for reason in ADMISSION_REASONS:
            self.admission_rejections.labels(model_name, reason)
        if multiprocess:
            MultiProcessCollector(self.registry)
        self.registry.register(_EngineCollector(self))

    # --- hot path: called once per output batch of a request -----------------------

    def observe_gap(self, gap_s: float) -> None:
        """Buffered: the gaps of one engine output (a token of every running stream)
        reach the histogram together, once the streams woken by it have run."""
        gaps = self._gaps
        gaps.append(gap_s)
        if len(gaps) == 1:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._flush_gaps)

    def _flush_gaps(self) -> None:
        """One add per bucket touched and one to the sum, where observe() per gap
        writes the multiprocess files twice a gap (1.1 us here: ~2-3 % of an API server's
        CPU on a streamed token). prometheus_client has no bulk observe; this adds
        to the labelled histogram's own values (_sum, _buckets, _upper_bounds: the
        same in every release since 0.0.x), counting a gap in the first bucket whose
        bound is at or above it, as observe() does."""
        gaps, self._gaps = self._gaps, []
        child = self.itl
        bounds = child._upper_bounds
        counts = [0] * len(bounds)
        for gap in gaps:
            counts[bisect.bisect_left(bounds, gap)] += 1
        child._sum.inc(sum(gaps))
        for i, count in enumerate(counts):
            if count:
                child._buckets[i].inc(count)

    def admission_rejected(self, reason: str) -> None:
        self.admission_rejections.labels(self.model_name, reason).inc()

    def observe_request(self, gen: Generation, params_n: int) -> None:
        finished = time.time()
        for choice in gen.choices:
            self._observe_choice(choice, gen.arrival_time, finished)
        self.prompt_tokens.inc(gen.num_prompt_tokens)
        self.n_param.observe(params_n)
        self.max_generation.observe(max(c.num_generated for c in gen.choices))

    def _observe_choice(self, c: Choice, arrival: float, finished: float) -> None:
        reason = c.finish_reason or "abort"
        success = self.success.get(reason)
        if success is None:
            success = self.success_by_reason.labels(self.model_name, reason)
        success.inc()
        self.generation_tokens.inc(c.num_generated)
        self.prompt_tokens_hist.observe(len(c.prompt_ids))
        self.generation_tokens_hist.observe(c.num_generated)
        self.max_tokens_param.observe(c.params.max_tokens)
        self.e2e.observe(finished - arrival)
        if c.first_token_time:
            ttft = c.first_token_time - arrival
            queued = min(c.queue_time_s, ttft)
            self.ttft.observe(ttft)
            self.queue.observe(queued)
            self.prefill.observe(ttft - queued)
            self.inference.observe(finished - arrival - queued)
            self.decode.observe(finished - c.first_token_time)
            if c.num_generated > 1:
                self.tpot.observe((finished - c.first_token_time) / (c.num_generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine gauges and counters from the latest stats, one series per engine."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self):
        p, name = self.m.prefix, self.m.model_name
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily(
            p + "num_requests_running", "Requests in the running batch.", labels=labels
        )
        waiting = GaugeMetricFamily(p + "num_requests_waiting", "Requests waiting.", labels=labels)
        waiting_by_reason = GaugeMetricFamily(
            p + "num_requests_waiting_by_reason",
            "Waiting requests by reason: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = held back by a transient constraint (zserve defers none). They "
            "sum to num_requests_waiting.",
            labels=[*labels, "reason"],
        )
        kv = GaugeMetricFamily(
            p + "kv_cache_usage_perc", "KV cache usage (1 = full).", labels=labels
        )
        blocks = GaugeMetricFamily(
            p + "num_kv_cache_total_blocks", "KV cache blocks.", labels=labels
        )
        queries = CounterMetricFamily(
            p + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels=labels,
        )
        hits = CounterMetricFamily(
            p + "prefix_cache_hits", "Prompt tokens found in the cache.", labels=labels
        )
        preempt = CounterMetricFamily(p + "num_preemptions", "Preemptions.", labels=labels)
        iteration = HistogramMetricFamily(
            p + "iteration_tokens_total", "Tokens per engine step.", labels=labels
        )
        preemptions = HistogramMetricFamily(
            p + "request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            labels=labels,
        )
        cache_info = GaugeMetricFamily(
            p + "cache_config_info",
            "The KV cache's configuration (as labels).",
            labels=[*labels, "block_size", "num_gpu_blocks", "cache_dtype", "device"],
        )
        for engine in self.m.client.engines:
            s = engine.stats
            values = [name, str(engine.rank)]
            if engine.ready is not None:
                r = engine.ready
                cache_info.add_metric(
                    [*values, str(r.block_size), str(r.num_kv_blocks), r.dtype, r.device], 1
                )
            if s.iteration_tokens_counts:
                buckets = _cumulative(ITERATION_TOKEN_BUCKETS, s.iteration_tokens_counts)
                iteration.add_metric(values, buckets, s.iteration_tokens_sum)
            if s.request_preemptions_counts:
                buckets = _cumulative(REQUEST_PREEMPTION_BUCKETS, s.request_preemptions_counts)
                preemptions.add_metric(values, buckets, s.request_preemptions_sum)
            running.add_metric(values, s.num_running)
            waiting.add_metric(values, s.num_waiting)
            waiting_by_reason.add_metric([*values, "capacity"], s.num_waiting)
            waiting_by_reason.add_metric([*values, "deferred"], 0)
            kv.add_metric(values, s.kv_cache_usage)
            blocks.add_metric(values, s.num_total_blocks)
            queries.add_metric(values, s.prefix_cache_queries)
            hits.add_metric(values, s.prefix_cache_hits)
            preempt.add_metric(values, s.num_preemptions)
        yield from (running, waiting, waiting_by_reason, kv, blocks, queries, hits, preempt)
        yield from (iteration, preemptions, cache_info)


def _cumulative(bounds: tuple[int, ...], counts: list[int]) -> list[tuple[str, int]]:
    """An engine's per-bucket counts (then one for larger values) as Prometheus buckets."""
    total, buckets = 0, []
    for bound, count in zip((*bounds, "+Inf"), counts, strict=False):
        total += count
        buckets.append((bound if bound == "+Inf" else str(float(bound)), total))
    return buckets


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


_pid = os.getpid()


def _note_fork() -> None:
    global _pid
    _pid = os.getpid()


def _cached_pid() -> int:
    return _pid


# In multiprocess mode every observe() asks prometheus_client's value class whether the
# process forked since (to move to a file of its own); by default that is os.getpid(), a
# system call, two per histogram observation: ~5 % of an API server's CPU on a streamed
# token (py-spy, 32 streams). The same check against a pid refreshed after each fork.
if multiprocess_dir() is not None:
    os.register_at_fork(after_in_child=_note_fork)
    values.ValueClass = values.MultiProcessValue(process_identifier=_cached_pid)
