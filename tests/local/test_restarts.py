"""The restart rule on its own, with a hand-moved clock: back-off doubling, its cap and reset,
and when the fleet gives up on a slot."""

from __future__ import annotations

import pytest

from phasefleet.local.restarts import CrashLoop, RestartConfig


def test_back_off_doubles_for_crashes_in_a_row_up_to_the_cap() -> None:
    loop = CrashLoop(RestartConfig(first_backoff_s=1.0, max_backoff_s=30.0, max_crashes=100))
    now, delays = 0.0, []
    for _ in range(8):
        verdict = loop.crashed("decode-1", now, served_s=5.0)  # up, but not for long
        assert verdict.delay_s is not None
        delays.append(verdict.delay_s)
        now += verdict.delay_s + 5.0
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]


def test_a_run_that_served_long_enough_starts_the_back_off_over() -> None:
    loop = CrashLoop(RestartConfig(first_backoff_s=1.0, reset_after_s=60.0, max_crashes=100))
    assert [loop.crashed("prefill-0", t, served_s=0.0).delay_s for t in (0, 2, 5)] == [1, 2, 4]
    assert loop.crashed("prefill-0", 100.0, served_s=60.0).delay_s == 1
    assert loop.crashed("prefill-0", 102.0, served_s=0.0).delay_s == 2


def test_slots_are_counted_apart() -> None:
    loop = CrashLoop(RestartConfig(first_backoff_s=1.0, max_crashes=2))
    assert loop.crashed("decode-1", 0.0, served_s=0.0).delay_s == 1
    assert loop.crashed("decode-2", 1.0, served_s=0.0).delay_s == 1
    assert loop.crashed("router", 2.0, served_s=0.0).delay_s == 1
    assert loop.crashed("decode-1", 3.0, served_s=0.0).delay_s is None


def test_max_crashes_within_the_window_give_up_and_older_crashes_fall_out() -> None:
    config = RestartConfig(max_crashes=3, crash_window_s=600.0, reset_after_s=60.0)
    loop = CrashLoop(config)
    # Crashes 6 minutes apart, each after 6 minutes up: never 3 within 10 minutes.
    verdicts = [loop.crashed("decode-1", 360.0 * i, served_s=360.0) for i in range(6)]
    assert [(v.crashes_in_window, v.delay_s) for v in verdicts] == [(1, 1)] + [(2, 1)] * 5
    # Then, the last of those more than 10 minutes ago, three quick ones: the third gives up.
    assert loop.crashed("decode-1", 2500.0, served_s=360.0).crashes_in_window == 1
    assert loop.crashed("decode-1", 2501.0, served_s=0.0).crashes_in_window == 2
    given_up = loop.crashed("decode-1", 2503.0, served_s=0.0)
    assert (given_up.crashes_in_window, given_up.delay_s) == (3, None)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (RestartConfig(first_backoff_s=0), "--restart-backoff must be > 0 and at most 30 seconds"),
        (RestartConfig(first_backoff_s=45), "--restart-backoff must be > 0 and at most 30 seconds"),
        (RestartConfig(max_crashes=0), "--max-crashes must be >= 1, got 0"),
    ],
)
def test_a_bad_config_names_the_flag(config: RestartConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CrashLoop(config)
