"""Serving metrics against values computed by hand."""

from __future__ import annotations

import pytest

from benchmarks.client import RequestResult
from benchmarks.report import metrics_json, percentile_key
from benchmarks.stats import (
    Distribution,
    compute_metrics,
    count_missing_output_tokens,
    meets_slos,
    parse_goodput,
    peak_concurrency,
    percentile,
    timeline,
    tpot,
)

pytestmark = pytest.mark.timeout(30)


def ok(start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10) -> RequestResult:
    return RequestResult(
        success=True,
        prompt_len=prompt,
        output_tokens=tokens,
        usage_reported=True,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        generated_text="x" * tokens,
    )


def failed(start: float = 0.0) -> RequestResult:
    return RequestResult(success=False, error="HTTP 500: boom", prompt_len=10, start_time=start)


# Three completed requests and one failure, over a 2-second run:
#   A: ttft 0.1, gaps 0.1 0.1 0.2 → e2e 0.5, 5 tokens, tpot (0.5−0.1)/4 = 0.1
#   B: ttft 0.3, gaps 0.2        → e2e 0.5, 3 tokens, tpot 0.2/2 = 0.1
#   C: ttft 0.2, no gap          → e2e 0.2, 1 token, no tpot
RUN = [
    ok(0.0, 0.1, [0.1, 0.1, 0.2], 5),
    ok(0.0, 0.3, [0.2], 3),
    ok(1.0, 0.2, [], 1),
    failed(),
]


def test_percentile_interpolates_between_closest_ranks():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7·(4−3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0


def test_percentile_does_not_depend_on_input_order():
    assert percentile([4.0, 1.0, 3.0, 2.0], 25) == percentile([1.0, 2.0, 3.0, 4.0], 25) == 1.75


def test_distribution_is_in_milliseconds_with_population_std():
    d = Distribution.of([0.1, 0.2, 0.3, 0.6], [50, 99])
    assert d.mean == pytest.approx(300.0)
    assert d.median == pytest.approx(250.0)
    # deviations −200, −100, 0, 300 ms → variance (4+1+0+9)·10⁴/4 = 35000
    assert d.std == pytest.approx(35000**0.5)
    assert d.percentiles[50] == pytest.approx(250.0)
    assert d.percentiles[99] == pytest.approx(591.0)  # rank 2.97: 300 + 0.97·300


def test_tpot_excludes_the_first_token_and_is_zero_for_one_token():
    assert tpot(RUN[0]) == pytest.approx(0.1)
    assert tpot(RUN[1]) == pytest.approx(0.1)
    assert tpot(RUN[2]) == 0.0


def test_run_metrics_count_completed_failed_tokens_and_throughput():
    m = compute_metrics(RUN, duration=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 30  # failed requests count no tokens
    assert m.total_output_tokens == 9
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(19.5)
    assert m.request_goodput is None


def test_run_metrics_latency_distributions():
    m = compute_metrics(RUN, duration=2.0, percentiles=[50, 99])
    assert m.ttft.mean == pytest.approx(200.0)  # (100 + 300 + 200) / 3
    assert m.ttft.median == pytest.approx(200.0)
    assert m.tpot.mean == pytest.approx(100.0)  # A and B only
    assert m.itl.mean == pytest.approx(150.0)  # gaps 100 100 200 200 pooled
    assert m.itl.median == pytest.approx(150.0)
    assert m.itl.percentiles[99] == pytest.approx(200.0)
    assert m.e2el.mean == pytest.approx(400.0)  # (500 + 500 + 200) / 3
    assert m.e2el.percentiles[50] == pytest.approx(500.0)


def test_goodput_counts_completed_requests_meeting_every_slo():
    # ttft ≤ 250 ms keeps A and C; e2el ≤ 400 ms then keeps only C
    assert compute_metrics(RUN, 2.0, slos={"ttft": 250}).request_goodput == pytest.approx(1.0)
    both = compute_metrics(RUN, 2.0, slos={"ttft": 250, "e2el": 400})
    assert both.request_goodput == pytest.approx(0.5)
    # tpot ≤ 100 ms: A and B exactly at the limit, C has tpot 0 → all three
    tp = compute_metrics(RUN, 2.0, slos={"tpot": 100.0001})
    assert tp.request_goodput == pytest.approx(1.5)
    assert not meets_slos(failed(), {"ttft": 1e9})


def test_goodput_flags_parse_and_reject_unknown_metrics():
    assert parse_goodput(["ttft:200", "tpot:50.5", "e2el:1000"]) == {
        "ttft": 200.0,
        "tpot": 50.5,
        "e2el": 1000.0,
    }
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_no_completed_request_gives_zero_metrics_not_an_error():
    m = compute_metrics([failed(), failed()], duration=1.0)
    assert (m.completed, m.failed) == (0, 2)
    assert m.ttft.mean == 0.0 and m.output_throughput == 0.0


def test_missing_usage_is_filled_by_the_tokenizer():
    class Words:
        def count(self, text: str) -> int:
            return len(text.split())

    r = ok(0.0, 0.1, [0.1], 0)
    r.output_tokens, r.generated_text = None, "a b c"
    assert count_missing_output_tokens([r, RUN[0]], Words()) == 1
    assert r.output_tokens == 3
    assert RUN[0].output_tokens == 5


def test_timeline_spreads_tokens_over_chunks_and_tracks_requests_in_flight():
    # A: chunks at 0.1 0.2 0.3 0.5 (5 tokens → 1.25 each); C: one chunk at 1.2 (1 token)
    tl = timeline([RUN[0], RUN[2]], bucket_s=1.0)
    assert tl.tokens_per_s == pytest.approx([5.0, 1.0])
    # A is busy 0.0–0.5 s, C 1.0–1.2 s
    assert tl.in_flight == pytest.approx([0.5, 0.2])


def test_peak_concurrency_is_the_most_requests_open_at_once():
    assert peak_concurrency(RUN) == 2
    back_to_back = [ok(0.0, 0.5, [], 1), ok(0.5, 0.5, [], 1)]
    assert peak_concurrency(back_to_back) == 1


def test_json_uses_vllm_field_names():
    out = metrics_json(compute_metrics(RUN, 2.0, percentiles=[50, 99.9]))
    for key in (
        "completed",
        "failed",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p50_ttft_ms",
        "p99.9_tpot_ms",
        "mean_itl_ms",
        "median_e2el_ms",
    ):
        assert key in out
    assert percentile_key(90.0) == "p90"
