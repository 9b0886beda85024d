"""histogram_quantile: PromQL's interpolation inside the bucket that holds the rank."""

from __future__ import annotations

import math

import pytest

from phasefleet.autoscale.histogram import histogram_quantile

INF = math.inf
# 10 observations: 2 in (0, 0.1], 6 in (0.1, 0.5], 2 in (0.5, 1]
BUCKETS = [(0.1, 2.0), (0.5, 8.0), (1.0, 10.0), (INF, 10.0)]


def test_interpolates_linearly_inside_the_bucket_holding_the_rank() -> None:
    # rank 5 is the 3rd of the 6 observations in (0.1, 0.5]: 0.1 + 0.4 * 3/6
    assert histogram_quantile(0.5, BUCKETS) == pytest.approx(0.3)
    # rank 9 is the 1st of 2 in (0.5, 1]
    assert histogram_quantile(0.9, BUCKETS) == pytest.approx(0.75)
    assert histogram_quantile(1.0, BUCKETS) == pytest.approx(1.0)


def test_first_bucket_starts_at_zero() -> None:
    assert histogram_quantile(0.1, BUCKETS) == pytest.approx(0.05)  # rank 1 of 2 in (0, 0.1]
    assert histogram_quantile(0.0, BUCKETS) == 0.0


def test_rank_in_the_inf_bucket_gives_the_highest_finite_bound() -> None:
    buckets = [(0.1, 1.0), (1.0, 2.0), (INF, 10.0)]
    assert histogram_quantile(0.5, buckets) == 1.0


def test_bucket_order_does_not_matter() -> None:
    assert histogram_quantile(0.5, reversed(BUCKETS)) == pytest.approx(0.3)


def test_no_observations_or_no_inf_bucket_is_none() -> None:
    assert histogram_quantile(0.9, [(0.1, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.9, []) is None
    assert histogram_quantile(0.9, [(0.1, 1.0), (0.5, 3.0)]) is None


def test_a_dip_in_cumulative_counts_is_evened_out() -> None:
    # (0.5 -> 7) below its predecessor's 8 counts as 8, as PromQL's monotonicity fix does
    dipped = [(0.1, 2.0), (0.25, 8.0), (0.5, 7.0), (1.0, 10.0), (INF, 10.0)]
    assert histogram_quantile(0.85, dipped) == pytest.approx(0.5 + 0.5 * (8.5 - 8) / 2)


def test_quantile_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, BUCKETS)
