"""WindowPeak: the arithmetic of the workers' peak gauges (and the replay's replicas)."""

from __future__ import annotations

import pytest

from phasefleet.autoscale.peaks import WindowPeak


def test_the_peak_is_the_highest_value_of_the_last_window() -> None:
    peak = WindowPeak(window_s=30)
    assert peak.peak(now=0.0) == 0.0  # nothing observed
    peak.observe(3, now=100.2)
    peak.observe(9, now=100.7)  # the same second: its highest is kept
    peak.observe(2, now=110.0)
    assert peak.peak(now=110.5) == 9
    assert peak.peak(now=129.9) == 9  # second 100 is within the last 30 (100..129)
    assert peak.peak(now=130.0) == 2  # second 100 has left the window
    assert peak.peak(now=140.0) == 0.0  # so has second 110


def test_a_value_observed_with_an_older_clock_reading_counts_in_the_newest_second() -> None:
    """Two threads may observe out of order: the late one is not lost."""
    peak = WindowPeak(window_s=5)
    peak.observe(1, now=10.0)
    peak.observe(7, now=9.5)
    assert peak.peak(now=10.0) == 7


def test_it_keeps_one_entry_a_second_whatever_the_step_rate() -> None:
    peak = WindowPeak(window_s=3)
    for k in range(1000):
        peak.observe(k % 7, now=k * 0.01)
    peak.observe(1, now=20.0)
    assert len(peak._seconds) <= 4 and peak.peak(now=20.0) == 1


def test_a_window_under_a_second_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s must be >= 1 second"):
        WindowPeak(window_s=0)
