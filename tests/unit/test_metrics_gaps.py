"""Inter-token gaps reach the ITL histogram buffered, once per engine output: the same
buckets, count and sum as observe() per gap, bounds included."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram

from frontend.metrics import _ITL, Metrics

pytestmark = pytest.mark.timeout(60)


def samples(histogram) -> dict:
    (family,) = histogram.collect()
    return {
        (s.name, s.labels.get("le")): s.value for s in family.samples if "_created" not in s.name
    }


def test_buffered_gaps_land_in_the_buckets_observe_would_choose():
    # The client only names this API server in a gauge here.
    metrics = Metrics("zs", "m", SimpleNamespace(client_index=0), max_model_len=1024)
    reference = Histogram(
        "zs:inter_token_latency_seconds",
        "",
        ["model_name"],
        buckets=_ITL,
        registry=CollectorRegistry(),
    )
    gaps = [0.0, 0.004, 0.01, 0.0100001, *_ITL, 79.9, 80.0, 80.1, 1e6]

    async def two_outputs():
        for gap in gaps[:7]:
            metrics.observe_gap(gap)
        assert samples(metrics.itl)[("zs:inter_token_latency_seconds_count", None)] == 0
        await asyncio.sleep(0)  # the streams woken by an output ran: the gaps are in
        for gap in gaps[7:]:
            metrics.observe_gap(gap)
        await asyncio.sleep(0)

    asyncio.run(two_outputs())
    for gap in gaps:
        reference.labels("m").observe(gap)
    got, want = samples(metrics.itl), samples(reference)
    assert got == pytest.approx(want) and want[
        ("zs:inter_token_latency_seconds_count", None)
    ] == len(gaps)
