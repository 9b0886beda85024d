"""Scale to zero and back (autoscale/zero.py through policy.decide): a pool with minReplicas 0
idles to zero only after the whole window without requests, wakes to one at once when the router
holds requests, and stays up while anything runs."""

from __future__ import annotations

from phasefleet.autoscale.policy import PolicyState, PoolLimits, ScalingConfig, decide
from phasefleet.autoscale.signals import PoolSignals, Signals

INTERVAL = 15.0
AFTER = 60.0  # scaleToZeroAfterSeconds


def aggregated(min_replicas: int = 0) -> ScalingConfig:
    return ScalingConfig(
        pools={"worker": PoolLimits(min_replicas, 4, 0, max_num_seqs=8)},
        interval_s=INTERVAL,
        scale_down_stabilization_s=300.0,
        scale_to_zero_after_s=AFTER,
    )


def worker(n: int, running: float = 0.0) -> Signals:
    pools = {"worker": PoolSignals(reporting=n, running=running, waiting=0.0, kv_usage_sum=0.0)}
    return Signals(sampled_at=0.0, window_s=INTERVAL, pools=pools)


def at(signals: Signals, now: float) -> Signals:
    return Signals(now, signals.window_s, signals.pools, held=signals.held)


def run(
    config: ScalingConfig, size: int, signals: Signals, start: float, end: float, state: PolicyState
) -> tuple[int, PolicyState, list[str]]:
    """Decisions every interval from `start` to `end` with the same signals; the pool is
    resized at once to each decision."""
    reasons = []
    now = start
    while now <= end:
        decision = decide(config, at(signals, now), {"worker": size}, state, now)
        size, state = decision.pools["worker"].desired, decision.state
        reasons.append(decision.pools["worker"].reason)
        now += INTERVAL
    return size, state, reasons


def test_an_idle_pool_goes_to_zero_only_after_the_whole_window() -> None:
    config = aggregated()
    size, state, _ = run(config, 1, worker(1, running=2.0), 0.0, 30.0, PolicyState())
    assert size >= 1  # the policy's own size while requests run
    # the last request ran at 30 s; idle from then on: kept at one for the window, then zero
    size, state, reasons = run(config, size, worker(size), 45.0, 30.0 + AFTER - INTERVAL, state)
    assert size >= 1  # the policy's own down window (300 s) holds it here; zero.py would too
    size, state, reasons = run(config, size, worker(size), 30.0 + AFTER, 30.0 + AFTER, state)
    assert size == 0
    assert reasons[-1].endswith("->0: no request for 60 s (scale to zero)")
    size, state, _ = run(config, 0, Signals(0.0, INTERVAL), 200.0, 400.0, state)
    assert size == 0  # nothing held: stays at zero


def test_requests_held_at_the_router_wake_the_pool_at_once() -> None:
    config = aggregated()
    zero = Signals(0.0, INTERVAL, held={"worker": 3.0})
    state = PolicyState(busy_at=-1000.0)
    decision = decide(config, zero, {"worker": 0}, state, 0.0)
    pool = decision.pools["worker"]
    assert pool.desired == 1
    assert pool.reason == "worker 0->1: the router holds 3 requests (wake from zero)"
    assert decision.state.busy_at == 0.0
    assert decision.state.last_scale_up_time["worker"] == 0.0


def test_a_pool_the_policy_would_empty_stays_at_one_until_the_window_ends() -> None:
    config = ScalingConfig(pools={"worker": PoolLimits(0, 4)}, interval_s=INTERVAL,
                           scale_down_stabilization_s=0.0, scale_to_zero_after_s=AFTER)  # fmt: skip
    size, state, reasons = run(config, 1, worker(1), 0.0, AFTER - INTERVAL, PolicyState())
    assert size == 1
    assert reasons[-1] == "worker stays at 1: idle 45 s of the 60 s before zero"
    size, _, _ = run(config, 1, worker(1), AFTER, AFTER, state)
    assert size == 0


def test_a_busy_pool_with_min_zero_never_drops_to_zero() -> None:
    size, _, _ = run(aggregated(), 1, worker(1, running=1.0), 0.0, 2000.0, PolicyState())
    assert size >= 1


def test_pools_with_a_minimum_above_zero_are_left_to_the_policy() -> None:
    size, _, _ = run(aggregated(min_replicas=1), 1, worker(1), 0.0, 2000.0, PolicyState())
    assert size >= 1
    held = Signals(0.0, INTERVAL, worker(2).pools, held={"worker": 1})
    decision = decide(aggregated(2), held, {"worker": 2}, PolicyState(), 0.0)
    assert "zero" not in decision.pools["worker"].reason


def test_held_requests_wake_every_pool_of_a_disaggregated_service() -> None:
    config = ScalingConfig(
        pools={"prefill": PoolLimits(0, 2), "decode": PoolLimits(0, 2)},
        interval_s=INTERVAL,
        scale_to_zero_after_s=AFTER,
    )
    decision = decide(
        config,
        Signals(0.0, INTERVAL, held={"decode": 2.0}),
        {"prefill": 0, "decode": 0},
        PolicyState(),
        0.0,
    )
    assert {r: p.desired for r, p in decision.pools.items()} == {"prefill": 1, "decode": 1}
