"""The disaggregated simulator's late prompts last: a prompt that would miss the TTFT target if
queued now waits until a prefill replica is idle."""

from __future__ import annotations

import numpy as np

from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import Fleet, simulate
from phasefleet.plan.trace import Trace

POOLS = {"prefill": 1, "decode": 1}
TARGET_S = 1.05  # off the 0.1 s grid of the arrivals, so no TTFT sits on it


def curves() -> Curves:
    return Curves(
        name="test",
        prefill=(0.0, 0.001, 0.0),  # 1 ms per prompt token: a 400-token prompt takes 0.4 s
        decode=(0.01, 0.0, 0.0),
        kv_capacity_tokens=100_000,
        max_num_seqs=64,
        startup_s=5.0,
        handoff_bytes_per_s=1e12,
        kv_bytes_per_token=1,
    )


def burst() -> Trace:
    """Twenty 300-token prompts in the first 2 s (6 s of prefill for the one replica, 0.3 s
    each), then four more, 2 s apart from 3.02 s: first come, first served, prompts 4-19 and
    the two later arrivals that meet the queue miss the target."""
    arrivals = [0.1 * k for k in range(20)] + [3.02 + 2.0 * k for k in range(4)]
    n = len(arrivals)
    return Trace("t", np.array(arrivals), np.full(n, 300), np.full(n, 3))


def run(late_after_s: float | None, late_limit_s: float = 60.0) -> Fleet:
    return simulate(
        burst(),
        curves(),
        lambda fleet, now: POOLS,
        POOLS,
        dt=0.05,
        late_after_s=late_after_s,
        late_limit_s=late_limit_s,
    )


def ttft(fleet: Fleet) -> np.ndarray:
    return fleet.first_token - fleet.trace.arrival


def test_first_come_first_served_by_default() -> None:
    fleet = run(None)
    assert fleet.deferred == []
    met = ttft(fleet) <= TARGET_S
    assert list(np.flatnonzero(met)) == [0, 1, 2, 3, 22, 23]


def test_late_prompts_wait_for_an_idle_replica_and_the_others_meet_the_target() -> None:
    late = run(TARGET_S)
    # a prompt goes late when it would wait over the target for the replica (4, 5, 8, 11, ...
    # wait just under it, and miss by their own prefill)
    assert late.deferred == [6, 7, 9, 10, 12, 13, 15, 16, 18, 19]
    met = ttft(late) <= TARGET_S
    assert list(np.flatnonzero(met)) == [0, 1, 2, 3, 20, 21, 22, 23]  # the later ones go first
    # every request is answered: the late ones after the replica was idle, oldest first
    assert np.isfinite(late.finish).all()
    starts = late.prefill_start[late.deferred]
    assert list(starts) == sorted(starts)


def test_a_prompt_that_can_meet_the_target_is_not_held_back() -> None:
    fleet = run(TARGET_S)
    assert np.allclose(ttft(fleet)[:4], [0.3, 0.5, 0.7, 0.9])


def test_a_late_prompt_that_waited_the_limit_is_queued_in_its_turn() -> None:
    unlimited, limited = run(TARGET_S), run(TARGET_S, late_limit_s=2.0)
    assert unlimited.prefill_start[20] < unlimited.prefill_start[19]  # went ahead of it
    # by 3.02 s the late prompts have waited 2 s: they are queued, and prompt 20 behind them
    assert limited.prefill_start[20] > limited.prefill_start[19]
    assert np.isfinite(limited.finish).all()
