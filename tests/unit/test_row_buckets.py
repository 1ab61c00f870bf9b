"""The row counts the packed matmuls run on, and that each one is built at start."""

from __future__ import annotations

import pytest
import torch

from engine_core.native_linear import Linear, row_bucket, row_buckets

pytestmark = pytest.mark.timeout(60)


def test_small_counts_are_exact_and_larger_ones_round_up_by_at_most_an_eighth():
    assert [row_bucket(m) for m in range(1, 17)] == list(range(1, 17))
    assert row_bucket(17) == 32 and row_bucket(256) == 256 and row_bucket(257) == 288
    assert row_bucket(1537) == 1664 and row_bucket(2048) == 2048
    for m in range(17, 8193):
        b = row_bucket(m)
        assert b >= m and row_bucket(b) == b
        if m > 256:
            assert b - m <= m / 8, m


def test_the_buckets_up_to_the_step_budget_are_few():
    buckets = row_buckets(2048)
    assert len(buckets) == 55
    assert buckets == sorted({row_bucket(m) for m in range(1, 2049)})


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_a_warmed_packed_linear_answers_like_f_linear_at_every_bucket():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=g).to(torch.bfloat16)
    linear = Linear(weight)
    linear.warm_up(300)
    for rows in (1, 17, 257, 300):
        x = torch.randn(rows, 32, generator=g).to(torch.bfloat16)
        want = torch.nn.functional.linear(x, weight)
        torch.testing.assert_close(linear(x), want, atol=2e-2, rtol=2e-2)
