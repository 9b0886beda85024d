"""The disaggregated simulator's phase boundary: prompts a decode replica prefills itself."""

from __future__ import annotations

import numpy as np
import pytest

from phasefleet.api.boundary import PhaseBoundary
from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import Fleet, simulate
from phasefleet.plan.trace import Trace

STEP_S = 0.01  # decode step, whatever the batch
POOLS = {"prefill": 1, "decode": 1}


def curves(chunk_tokens: int = 2048) -> Curves:
    return Curves(
        name="test",
        prefill=(0.0, 0.001, 0.0),  # 1 ms per prompt token, no fixed cost
        decode=(STEP_S, 0.0, 0.0),
        kv_capacity_tokens=100_000,
        max_num_seqs=8,
        startup_s=5.0,
        handoff_bytes_per_s=1e12,
        kv_bytes_per_token=1,
        chunk_tokens=chunk_tokens,
    )


def trace(arrivals: list[float], prompts: list[int], outputs: list[int]) -> Trace:
    return Trace("t", np.array(arrivals), np.array(prompts), np.array(outputs))


def run(
    t: Trace,
    boundary: PhaseBoundary | None,
    c: Curves | None = None,
    tpot_target_s: float | None = None,
) -> Fleet:
    return simulate(
        t,
        c or curves(),
        lambda fleet, now: POOLS,
        POOLS,
        dt=0.05,
        boundary=boundary,
        tpot_target_s=tpot_target_s,
    )


def test_a_short_prompt_under_the_threshold_is_prefilled_by_the_decode_replica() -> None:
    t = trace([0.0], [100], [11])
    fleet = run(t, PhaseBoundary(min_tokens=512))
    assert fleet.local_prefills == 1
    assert fleet.first_token[0] == pytest.approx(0.1)  # one step of 100 tokens, 1 ms each
    assert (fleet.finish[0] - fleet.first_token[0]) / 10 == pytest.approx(STEP_S, rel=0.01)
    assert run(t, None).local_prefills == 0


def test_decodes_beside_a_local_prefill_wait_for_its_chunks() -> None:
    # request 0 decodes (prefilled remotely, 600 tokens); request 1's 400-token prompt is
    # prefilled on the decode replica in chunks of 100 (the budget less the one decode)
    t = trace([0.0, 0.7], [600, 400], [101, 2])
    rule = PhaseBoundary(min_tokens=500)
    alone = run(trace([0.0], [600], [101]), rule, curves(101))
    beside = run(t, rule, curves(101))
    assert beside.local_prefills == 1
    # 4 mixed steps of 10 ms + 100 ms each instead of 10 ms: 0.4 s more for request 0
    slower = beside.finish[0] - alone.finish[0]
    assert slower == pytest.approx(0.4, abs=0.02)
    assert beside.first_token[1] - 0.7 == pytest.approx(0.44, abs=0.02)


def test_a_backlogged_prefill_pool_moves_long_prompts_to_the_decode_replica() -> None:
    # ten 1000-token prompts at once: 1 s each on the prefill replica
    t = trace([0.0] * 10, [1000] * 10, [3] * 10)
    fixed = run(t, PhaseBoundary(min_tokens=512))
    adaptive = run(t, PhaseBoundary(512, adaptive=True, local_max_tokens=3000))
    assert fixed.local_prefills == 0
    assert adaptive.local_prefills == 3  # as many as its 3000 tokens of room hold at once
    assert np.nanmax(adaptive.first_token) < np.nanmax(fixed.first_token) - 2.5


def test_a_decode_replica_over_its_tpot_share_takes_no_prefill() -> None:
    t = trace([0.0] * 10, [1000] * 10, [3] * 10)
    rule = PhaseBoundary(min_tokens=512, adaptive=True)
    # the first is taken by an idle replica; beside it a step is over 0.8 of the target
    assert run(t, rule, tpot_target_s=STEP_S).local_prefills == 1
    # steps of 1 s (the prompt in progress) + this one's 1 s over 3-token answers: within 2 s
    assert run(t, rule, tpot_target_s=2.5).local_prefills == 4  # as 4096 tokens of room hold


def test_an_idle_prefill_pool_takes_prompts_under_the_threshold() -> None:
    t = trace([0.0, 5.0], [200, 200], [5, 5])  # the pool is idle at each arrival
    assert run(t, PhaseBoundary(min_tokens=512)).local_prefills == 2
    assert run(t, PhaseBoundary(512, adaptive=True, idle_min_tokens=128)).local_prefills == 0
