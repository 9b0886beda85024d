"""The phase boundary rule: fixed threshold, and how the adaptive rule moves it with load."""

from __future__ import annotations

import pytest

from phasefleet.api.boundary import LocalLoad, PhaseBoundary

IDLE_DECODER = LocalLoad(prefill_tokens=0)
RULE = PhaseBoundary(
    min_tokens=512, adaptive=True, busy_backlog_s=0.5, idle_min_tokens=128, local_max_tokens=4096
)


def test_without_a_measured_backlog_the_threshold_decides() -> None:
    assert RULE.remote(512, None, IDLE_DECODER)
    assert not RULE.remote(511, None, IDLE_DECODER)


def test_the_fixed_rule_ignores_the_load() -> None:
    fixed = PhaseBoundary(adaptive=False)
    assert fixed.remote(2000, 30.0, IDLE_DECODER)
    assert not fixed.remote(200, 0.0, IDLE_DECODER)


def test_a_backlogged_prefill_pool_leaves_long_prompts_to_a_decode_worker_with_room() -> None:
    assert not RULE.remote(2000, 0.6, IDLE_DECODER)
    assert RULE.remote(2000, 0.5, IDLE_DECODER)  # at the target: not over it


def test_a_decode_worker_takes_no_more_prefill_than_its_token_bound() -> None:
    assert not RULE.remote(2000, 5.0, LocalLoad(prefill_tokens=2096))  # 4096 in all
    assert RULE.remote(2000, 5.0, LocalLoad(prefill_tokens=2097))


def test_a_decode_worker_takes_no_prefill_that_would_push_its_tpot_out() -> None:
    # TPOT with this prefill: recent ITL + its 1.4 s spread over a typical 100-token answer,
    # against 0.8 x 50 ms
    def load(itl_s: float, answer: float | None, decoding: int = 3) -> LocalLoad:
        return LocalLoad(0, itl_s, 0.05, prefill_s=1.4, output_tokens=answer, decoding=decoding)

    assert not RULE.remote(2000, 5.0, load(0.025, 100))  # 25 + 14 ms
    assert RULE.remote(2000, 5.0, load(0.027, 100))  # 27 + 14 ms
    assert RULE.remote(2000, 5.0, load(0.025, 10))  # short answers: 140 ms more each
    assert RULE.remote(2000, 5.0, load(0.025, None))  # none seen yet: all 1.4 s counts
    assert not RULE.remote(2000, 5.0, load(0.045, 10, decoding=0))  # nothing runs here
    assert not RULE.remote(2000, 5.0, LocalLoad(0, None, 0.05))  # nothing known: room


def test_an_idle_prefill_pool_takes_shorter_prompts_too() -> None:
    assert RULE.remote(128, 0.0, IDLE_DECODER)
    assert not RULE.remote(127, 0.0, IDLE_DECODER)
    assert not RULE.remote(128, 0.1, IDLE_DECODER)  # busy, not backlogged: the threshold


def test_zero_hands_off_every_prompt_whatever_the_load() -> None:
    every = PhaseBoundary(min_tokens=0, adaptive=True)
    assert every.remote(1, 30.0, IDLE_DECODER) and every.remote(5000, 30.0, IDLE_DECODER)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_tokens": -1}, "must be >= 0"),
        ({"busy_backlog_s": 0.0}, "busy_backlog_s must be > 0"),
        ({"tpot_share": 1.5}, "tpot_share must be in"),
    ],
)
def test_bad_knobs_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PhaseBoundary(**kwargs)  # type: ignore[arg-type]
