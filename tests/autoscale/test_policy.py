"""The scaling policy, driven by hand-made signals and a hand-moved clock."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from phasefleet.api.spec import parse_spec
from phasefleet.autoscale.policy import (
    Decision,
    PolicyState,
    PoolLimits,
    ScalingConfig,
    decide,
)
from phasefleet.autoscale.signals import MetricsUnavailable, PoolSignals, Signals

INTERVAL = 15.0
WINDOW = 300.0


def disaggregated(**overrides: Any) -> ScalingConfig:
    config = ScalingConfig(
        pools={"prefill": PoolLimits(1, 10, 1), "decode": PoolLimits(1, 10, 1)},
        ttft_s=0.5,
        tpot_s=0.05,
        interval_s=INTERVAL,
        scale_down_stabilization_s=WINDOW,
        max_step=2,
        peak_headroom=1.0,  # the other rules' arithmetic; the headroom has tests of its own
    )
    return replace(config, **overrides)


def calm_prefill(n: int, busy: float = 0.5) -> PoolSignals:
    return PoolSignals(reporting=n, busy_fraction=busy, prefill_backlog_tokens=0.0)


def calm_decode(n: int, kv: float = 0.5) -> PoolSignals:
    return PoolSignals(reporting=n, kv_usage_sum=kv * n, running=4.0 * n, waiting=0.0)


def signals(
    now: float,
    prefill: PoolSignals,
    decode: PoolSignals,
    ttft: float | None = 0.2,
    tpot: float | None = 0.03,
) -> Signals:
    return Signals(
        sampled_at=now,
        window_s=INTERVAL,
        pools={"prefill": prefill, "decode": decode},
        ttft_s=ttft,
        tpot_s=tpot,
    )


def step(
    config: ScalingConfig,
    sig: Signals | MetricsUnavailable,
    current: dict[str, int],
    state: PolicyState,
    now: float,
) -> Decision:
    return decide(config, sig, current, state, now)


def test_kv_over_target_grows_decode_with_a_sentence_a_person_can_read() -> None:
    config = disaggregated(kv_cache_target=0.7)
    sig = signals(0.0, calm_prefill(2), calm_decode(2, kv=0.91), tpot=0.041)
    decision = decide(config, sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["decode"].desired == 3
    assert decision.pools["decode"].reason == (
        "decode 2->3: KV usage 0.91 > target 0.70 (TPOT p90 41 ms, target 50 ms)"
    )
    assert decision.pools["prefill"].desired == 2
    assert decision.metrics_available and decision.scaling_limited is None


def test_ttft_over_target_grows_prefill_not_decode() -> None:
    sig = signals(0.0, calm_prefill(2, busy=0.9), calm_decode(2), ttft=0.9)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 3
    assert "TTFT p90 900 ms > target 500 ms" in decision.pools["prefill"].reason
    assert decision.pools["decode"].desired == 2


def test_a_latency_far_over_target_asks_for_a_quarter_more_at_most() -> None:
    """TTFT 10x its target on 8 replicas: 10 more, not 72 (capped by maxStep to 8 anyway, but
    remembered as the window's highest ask); how many more is for the capacity terms."""
    config = disaggregated(pools={"prefill": PoolLimits(1, 100, 1), "decode": PoolLimits(1, 10, 1)},
                           max_step=100)  # fmt: skip
    sig = signals(0.0, calm_prefill(8, busy=0.8), calm_decode(2), ttft=5.0)
    decision = decide(config, sig, {"prefill": 8, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 10
    assert decision.pools["prefill"].reason.startswith("prefill 8->10: TTFT p90 5000 ms > target")
    # 15 s of backlog at the pool's capacity: a doubled load for one window doubles the pool
    backlog = replace(sig.pools["prefill"], busy_fraction=1.0, prefill_backlog_tokens=600_000,
                      prompt_tokens_per_s=40_000)  # fmt: skip
    sig = replace(sig, pools={**sig.pools, "prefill": backlog})
    decision = decide(config, sig, {"prefill": 8, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 16
    assert "prompt backlog 15.0 s" in decision.pools["prefill"].reason


def test_a_burst_that_doubles_the_load_is_answered_in_the_next_interval() -> None:
    """Four saturated prefill replicas see twice the load for one 15 s interval: 15 s of
    backlog at their throughput, TTFT twice its target."""
    burst = PoolSignals(
        reporting=4, busy_fraction=1.0, prefill_backlog_tokens=600_000, prompt_tokens_per_s=40_000
    )
    sig = signals(0.0, burst, calm_decode(2), ttft=1.0)
    current = {"prefill": 4, "decode": 2}
    wide = decide(disaggregated(max_step=8), sig, current, PolicyState(), 0.0)
    assert wide.pools["prefill"].desired == 8
    assert wide.pools["prefill"].reason.startswith("prefill 4->8: prompt backlog 15.0 s > 0.25 s")
    bounded = decide(disaggregated(), sig, current, PolicyState(), 0.0)
    assert bounded.pools["prefill"].desired == 6  # maxStep 2


def calm_run(config: ScalingConfig, busy: dict[int, float], steps: int) -> dict[float, Decision]:
    """A prefill pool of 4 at busy 0.1 (busy[i] at step i), resized to each decision."""
    state, current, decisions = PolicyState(), {"prefill": 4, "decode": 2}, {}
    for i in range(steps):
        now = i * INTERVAL
        sig = signals(now, calm_prefill(current["prefill"], busy=busy.get(i, 0.1)),
                      calm_decode(2), ttft=0.1)  # fmt: skip
        decision = decisions[now] = step(config, sig, current, state, now)
        state, current["prefill"] = decision.state, decision.pools["prefill"].desired
    return decisions


def test_scale_down_waits_a_whole_window_then_lets_go_over_the_tail() -> None:
    """The pool's size before the first decision (4) counts as an ask: it holds fully for the
    window, then at a share falling to half over the tail (4 x 0.75 = 3 half-way), then the
    asks of busy 0.1 (4 x 0.1 / 0.8 -> 1) alone size the pool."""
    decisions = calm_run(disaggregated(), {}, int(2 * WINDOW / INTERVAL) + 2)
    sizes = {t: d.pools["prefill"].desired for t, d in decisions.items()}
    assert all(n == 4 for t, n in sizes.items() if t <= WINDOW), sizes
    assert list(sizes.values()) == sorted(sizes.values(), reverse=True)
    assert (sizes[1.5 * WINDOW], sizes[2 * WINDOW]) == (3, 1)
    first = next(d.pools["prefill"] for d in decisions.values() if d.pools["prefill"].changed)
    assert first.reason.startswith(
        "prefill 4->3: busy 0.10 <= target 0.80; no ask above 1 for 300 s, older asks still hold 3"
    )


def test_one_high_ask_in_the_window_holds_the_pool() -> None:
    """One busy interval 150 s in asks for all 4: the pool keeps 4 for a window after it, 3
    half-way through the tail, and 1 once the tail is over."""
    decisions = calm_run(disaggregated(), {10: 0.7}, 60)
    sizes = [d.pools["prefill"].desired for d in decisions.values()]
    assert all(n == 4 for n in sizes[:31]), sizes  # to 150 s + the window
    assert (sizes[40], sizes[50]) == (3, 1), sizes  # 150 s + 1.5 and 2 windows


def test_an_ask_past_max_replicas_is_remembered_as_max_replicas() -> None:
    """A TTFT 100x over a tiny target asks for 400 replicas of a pool capped at 4: the tail
    lets go of 4, not of 400 (which would hold the pool for the whole tail)."""
    config = disaggregated(pools={"prefill": PoolLimits(1, 4, 1), "decode": PoolLimits(1, 10, 1)})
    state, current = PolicyState(), {"prefill": 4, "decode": 2}
    sizes = []
    for i in range(51):
        now = i * INTERVAL
        busy, ttft = (0.9, 50.0) if i == 0 else (0.1, 0.1)
        sig = signals(now, calm_prefill(current["prefill"], busy=busy), calm_decode(2), ttft=ttft)
        decision = step(config, sig, current, state, now)
        state, current["prefill"] = decision.state, decision.pools["prefill"].desired
        sizes.append(current["prefill"])
        if i == 0:
            assert state.history["prefill"][-1] == (0.0, 4)
    assert all(n == 4 for n in sizes[:21]), sizes  # the window
    assert (sizes[30], sizes[40]) == (3, 1), sizes  # half-way through the tail, then its end


def test_replicas_still_starting_are_not_asked_for_twice() -> None:
    """Prefill went 2 -> 4 and two replicas still load: the same load asks for 4, not 6."""
    sig = signals(0.0, calm_prefill(2, busy=1.0), calm_decode(2), ttft=0.9)
    decision = decide(disaggregated(), sig, {"prefill": 4, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 4
    assert decision.pools["prefill"].reason.startswith("prefill stays at 4")


def test_never_below_min_nor_above_max_and_the_cap_is_reported() -> None:
    config = disaggregated(pools={"prefill": PoolLimits(2, 3, 1), "decode": PoolLimits(1, 10, 1)})
    hot = signals(0.0, calm_prefill(3, busy=1.0), calm_decode(2), ttft=2.0)
    capped = decide(config, hot, {"prefill": 3, "decode": 2}, PolicyState(), 0.0)
    assert capped.pools["prefill"].desired == 3
    assert capped.pools["prefill"].limited == "prefill is at maxReplicas 3 (asked for 4)"
    assert capped.scaling_limited == capped.pools["prefill"].limited
    config = replace(config, scale_down_stabilization_s=0.0)
    idle = signals(0.0, calm_prefill(3, busy=0.0), calm_decode(2), ttft=None)
    floored = decide(config, idle, {"prefill": 3, "decode": 2}, PolicyState(), 0.0)
    assert floored.pools["prefill"].desired == 2


def test_gpu_budget_goes_to_the_pool_further_from_its_slo() -> None:
    config = disaggregated(gpu_budget=5)
    # Prefill: TTFT 3x its target; decode: TPOT 1.5x its target. Both ask for 1 more.
    sig = signals(0.0, calm_prefill(2, busy=1.0), calm_decode(2, kv=0.9), ttft=1.5, tpot=0.075)
    decision = decide(config, sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 3
    assert decision.pools["decode"].desired == 2
    assert decision.scaling_limited is not None
    assert "gpuBudget 5 binds" in decision.scaling_limited
    assert decision.pools["decode"].limited == decision.scaling_limited
    assert decision.pools["prefill"].limited is None


def test_gpu_budget_counts_a_tensor_parallel_replica_at_its_degree() -> None:
    # Prefill replicas take 4 GPUs each (tensorParallelSize 4), decode replicas 1.
    pools = {"prefill": PoolLimits(1, 10, 4), "decode": PoolLimits(1, 10, 1)}
    config = disaggregated(pools=pools, gpu_budget=10)
    sig = signals(0.0, calm_prefill(2, busy=1.0), calm_decode(2), ttft=1.5)
    decision = decide(config, sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 2  # 2 x 4 + 2 x 1 = 10 GPUs; a 3rd needs 4
    assert decision.scaling_limited == (
        "gpuBudget 10 binds (14 GPUs asked): prefill gets 2 of 3 replicas (8 of 12 GPUs)"
    )


@pytest.mark.parametrize(
    "unavailable",
    [
        MetricsUnavailable("PrometheusUnreachable", "Prometheus at http://p:9090 refused"),
        MetricsUnavailable("NoSamples", "no series for this service"),
    ],
)
def test_missing_metrics_hold_every_pool(unavailable: MetricsUnavailable) -> None:
    config = disaggregated(scale_down_stabilization_s=0.0)
    decision = decide(config, unavailable, {"prefill": 3, "decode": 2}, PolicyState(), 0.0)
    assert {r: d.desired for r, d in decision.pools.items()} == {"prefill": 3, "decode": 2}
    assert not decision.metrics_available
    assert decision.metrics_reason == unavailable.reason
    assert decision.metrics_message == unavailable.message


def test_stale_metrics_hold_and_say_how_old() -> None:
    sig = signals(0.0, calm_prefill(3, busy=0.0), calm_decode(2), ttft=0.1)
    config = disaggregated(scale_down_stabilization_s=0.0)
    decision = decide(config, sig, {"prefill": 3, "decode": 2}, PolicyState(), 31.0)
    assert decision.pools["prefill"].desired == 3
    assert decision.metrics_reason == "StaleMetrics"
    assert "31 s old" in decision.metrics_message
    fresh = decide(config, sig, {"prefill": 3, "decode": 2}, PolicyState(), 29.0)
    assert fresh.metrics_available and fresh.pools["prefill"].desired == 1


def test_no_scale_down_for_a_window_after_metrics_come_back() -> None:
    config, state = disaggregated(), PolicyState()
    current = {"prefill": 4, "decode": 2}
    now = 0.0
    outage = MetricsUnavailable("PrometheusUnreachable", "down")
    state = decide(config, outage, current, state, now).state
    quiet = signals(WINDOW - 1, calm_prefill(4, busy=0.0), calm_decode(2), ttft=0.1)
    assert decide(config, quiet, current, state, WINDOW - 1).pools["prefill"].desired == 4
    quiet = signals(1.5 * WINDOW, calm_prefill(4, busy=0.0), calm_decode(2), ttft=0.1)
    assert decide(config, quiet, current, state, 1.5 * WINDOW).pools["prefill"].desired == 3
    quiet = signals(2 * WINDOW, calm_prefill(4, busy=0.0), calm_decode(2), ttft=0.1)
    assert decide(config, quiet, current, state, 2 * WINDOW).pools["prefill"].desired == 1


def test_a_pool_with_no_reporting_replica_holds_and_says_so() -> None:
    sig = signals(0.0, PoolSignals(reporting=0), calm_decode(2, kv=0.95), ttft=None)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 2
    assert decision.pools["decode"].desired == 3  # decode still scales on its own signals
    assert not decision.metrics_available and decision.metrics_reason == "NoSamples"
    assert "prefill" in decision.metrics_message


def test_without_slo_targets_a_pool_scales_on_capacity_alone() -> None:
    config = disaggregated(ttft_s=None, tpot_s=None, scale_down_stabilization_s=0.0)
    sig = signals(0.0, calm_prefill(2, busy=0.2), calm_decode(4, kv=0.1), ttft=9.0, tpot=9.0)
    decision = decide(config, sig, {"prefill": 2, "decode": 4}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 1
    assert decision.pools["decode"].desired == 1


def test_latency_near_its_target_blocks_a_scale_down() -> None:
    config = disaggregated(scale_down_stabilization_s=0.0)
    queued = replace(calm_prefill(4, busy=0.1), waiting=16.0)
    sig = signals(0.0, queued, calm_decode(2), ttft=0.45)
    decision = decide(config, sig, {"prefill": 4, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 4
    # with nothing waiting and the engines idle, TTFT is the prompts' length: it may shrink
    sig = signals(0.0, calm_prefill(4, busy=0.1), calm_decode(2), ttft=0.45)
    decision = decide(config, sig, {"prefill": 4, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 1


def test_a_slow_tpot_with_room_in_decode_does_not_grow_decode() -> None:
    """Long prompts with short answers: the KV hand-off before the second token makes TPOT,
    and decode has free KV and no queue, so more decode replicas would not help."""
    sig = signals(0.0, calm_prefill(2), calm_decode(2, kv=0.4), tpot=0.12)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["decode"].desired == 2
    loaded = signals(0.0, calm_prefill(2), calm_decode(2, kv=0.75), tpot=0.12)
    decision = decide(disaggregated(), loaded, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert (
        decision.pools["decode"].desired == 3
    )  # 2 x 1.25: TPOT 2.4x its target asks a quarter more
    assert "TPOT p90 120 ms > target 50 ms" in decision.pools["decode"].reason


def test_a_slow_ttft_from_long_prompts_on_idle_prefill_does_not_grow_prefill() -> None:
    idle = PoolSignals(reporting=2, busy_fraction=0.4, prefill_backlog_tokens=0.0, waiting=0.0)
    sig = signals(0.0, idle, calm_decode(2), ttft=0.9)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 2
    # a few prompts per replica waiting at the scrape is arrivals meeting, not a queue
    met = replace(idle, waiting=6.0)
    sig = signals(0.0, met, calm_decode(2), ttft=0.9)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 2
    queued = replace(idle, waiting=8.0)
    sig = signals(0.0, queued, calm_decode(2), ttft=0.9)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 3


def test_prompt_backlog_is_counted_in_seconds_of_capacity_not_of_demand() -> None:
    """10k tokens pending at 20k tokens/s prefilled is 0.5 s of demand, but the pool is busy a
    quarter of the time: it clears them in 0.125 s, under the 0.25 s allowed."""
    quarter = PoolSignals(
        reporting=2, busy_fraction=0.25, prefill_backlog_tokens=10_000, prompt_tokens_per_s=20_000
    )
    sig = signals(0.0, quarter, calm_decode(2), ttft=0.2)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 2
    full = replace(quarter, busy_fraction=1.0)
    sig = signals(0.0, full, calm_decode(2), ttft=0.2)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 3  # 0.5 s > 0.25 s: 2 x (1 + 0.25 / 15) -> 3


def test_a_backlog_before_any_prefill_asks_for_one_more_replica() -> None:
    """Prompts wait and the pool has prefilled nothing yet (no throughput to count the backlog
    in): one more replica, and the reason names the prompt backlog like the others."""
    stuck = PoolSignals(reporting=2, busy_fraction=1.0, prefill_backlog_tokens=427)
    sig = signals(0.0, stuck, calm_decode(2), ttft=0.2)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 3
    assert "prompt backlog 427 tokens, none prefilled yet" in decision.pools["prefill"].reason


def test_only_the_backlog_over_its_allowance_is_drained() -> None:
    """A 10 s TTFT target allows 5 s of backlog. 6 s of it on 12 replicas asks for 1 s over
    the allowance to be drained within the 15 s window: 12 x (1 + 1 / 15) -> 13. Draining it
    all (12 x (1 + 6 / 15) -> 17, 14 within maxStep) paid for long prompts arriving together."""
    busy = PoolSignals(
        reporting=12, busy_fraction=0.6, prefill_backlog_tokens=6 * 20_000,
        prompt_tokens_per_s=0.6 * 20_000,
    )  # fmt: skip
    config = disaggregated(
        ttft_s=10.0, pools={"prefill": PoolLimits(1, 32, 1), "decode": PoolLimits(1, 32, 1)}
    )
    sig = signals(0.0, busy, calm_decode(2), ttft=2.0)
    decision = decide(config, sig, {"prefill": 12, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["prefill"].desired == 13
    assert "prompt backlog 6.0 s > 5.00 s" in decision.pools["prefill"].reason


def test_requests_waiting_for_a_decode_slot_grow_decode() -> None:
    decode = PoolSignals(reporting=2, kv_usage_sum=1.6, running=16.0, waiting=16.0)
    sig = signals(0.0, calm_prefill(2), decode, tpot=0.03)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["decode"].desired == 4
    assert "16 requests waiting" in decision.pools["decode"].reason
    # the same queue while the KV caches are 20% full and batch slots free: requests added
    # since the last step, which more replicas would not admit sooner
    roomy = replace(decode, kv_usage_sum=0.4)
    sig = signals(0.0, calm_prefill(2), roomy, tpot=0.03)
    decision = decide(disaggregated(), sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["decode"].desired == 2


def test_aggregated_pool_reads_both_phases_signals() -> None:
    config = ScalingConfig(
        pools={"worker": PoolLimits(1, 8)}, ttft_s=0.5, tpot_s=0.05, peak_headroom=1.0
    )
    pool = PoolSignals(reporting=2, busy_fraction=0.5, kv_usage_sum=0.6)
    slow_tokens = Signals(0.0, INTERVAL, {"worker": pool}, ttft_s=0.1, tpot_s=0.1)
    assert (
        decide(config, slow_tokens, {"worker": 2}, PolicyState(), 0.0).pools["worker"].desired == 3
    )
    slow_first = Signals(0.0, INTERVAL, {"worker": pool}, ttft_s=0.75, tpot_s=0.01)
    assert (
        decide(config, slow_first, {"worker": 2}, PolicyState(), 0.0).pools["worker"].desired == 3
    )


def test_config_from_an_inference_service_spec() -> None:
    spec = parse_spec(
        {
            "model": {"image": {"path": "/models/m"}},
            "prefill": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6,
                        "resources": {"limits": {"nvidia.com/gpu": 1}}},
            "decode": {"replicas": 1, "maxReplicas": 4},
            "slo": {"ttftMs": 800, "percentile": 0.95},
            "autoscaling": {"enabled": True, "intervalSeconds": 5, "gpuBudget": 8},
        }
    )  # fmt: skip
    config = ScalingConfig.from_spec(spec, startup_s=42.0)
    assert config.pools == {
        "prefill": PoolLimits(1, 6, 1, max_num_seqs=64),
        "decode": PoolLimits(1, 4, 0, max_num_seqs=64),
    }
    assert (config.ttft_s, config.tpot_s, config.percentile) == (0.8, None, 0.95)
    assert (config.interval_s, config.gpu_budget, config.startup_s) == (5.0, 8, 42.0)
    assert config.signal_window_s == 30.0


@pytest.mark.parametrize(
    ("autoscaling", "window_s"),
    [({}, 30.0), ({"intervalSeconds": 60}, 120.0), ({"signalWindowSeconds": 10}, 10.0)],
)
def test_the_signal_window_is_30_s_or_two_intervals_unless_set(
    autoscaling: dict[str, Any], window_s: float
) -> None:
    spec = parse_spec(
        {
            "model": {"image": {"path": "/models/m"}},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
            "autoscaling": {"enabled": True, **autoscaling},
        }
    )
    assert ScalingConfig.from_spec(spec).signal_window_s == window_s


def test_full_batch_slots_grow_decode_though_the_kv_cache_is_half_empty() -> None:
    limits = PoolLimits(1, 10, 1, max_num_seqs=64)
    config = disaggregated(pools={"prefill": limits, "decode": limits})
    decode = PoolSignals(reporting=2, kv_usage_sum=0.6, running=128.0, waiting=1.0)
    sig = signals(0.0, calm_prefill(2), decode, tpot=0.03)
    decision = decide(config, sig, {"prefill": 2, "decode": 2}, PolicyState(), 0.0)
    assert decision.pools["decode"].desired == 3  # 129 requests / (64 slots x 0.8) = 2.5
    assert decision.pools["decode"].reason.startswith("decode 2->3: batch slots 1.00 > target")


def test_a_request_or_two_waiting_is_not_a_queue() -> None:
    decode = PoolSignals(reporting=1, kv_usage_sum=0.1, running=2.0, waiting=1.0)
    sig = signals(0.0, calm_prefill(1), decode, tpot=0.03)
    decision = decide(disaggregated(), sig, {"prefill": 1, "decode": 1}, PolicyState(), 0.0)
    assert decision.pools["decode"].desired == 1


def test_no_scale_down_while_new_replicas_may_still_be_loading() -> None:
    config = disaggregated(scale_down_stabilization_s=0.0, startup_s=60.0)
    hot = signals(0.0, calm_prefill(2, busy=1.0), calm_decode(2), ttft=0.9)
    state = decide(config, hot, {"prefill": 2, "decode": 2}, PolicyState(), 0.0).state
    quiet = signals(30.0, calm_prefill(2, busy=0.05), calm_decode(2), ttft=0.1)
    held = decide(config, quiet, {"prefill": 4, "decode": 2}, state, 30.0)
    assert held.pools["prefill"].desired == 4
    quiet = signals(61.0, calm_prefill(2, busy=0.05), calm_decode(2), ttft=0.1)
    late = decide(config, quiet, {"prefill": 4, "decode": 2}, state, 61.0)
    assert late.pools["prefill"].desired == 1  # a start-up later: those two are not coming
    quiet = signals(30.0, calm_prefill(4, busy=0.05), calm_decode(2), ttft=0.1)
    loaded = decide(config, quiet, {"prefill": 4, "decode": 2}, state, 30.0)
    assert loaded.pools["prefill"].desired == 1  # all four report: nothing is loading


def test_missing_metrics_still_honour_changed_bounds() -> None:
    config = disaggregated(pools={"prefill": PoolLimits(1, 2, 1), "decode": PoolLimits(2, 4, 1)})
    outage = MetricsUnavailable("PrometheusUnreachable", "down")
    decision = decide(config, outage, {"prefill": 3, "decode": 1}, PolicyState(), 0.0)
    assert {r: d.desired for r, d in decision.pools.items()} == {"prefill": 2, "decode": 2}
    assert "within minReplicas 1 .. maxReplicas 2" in decision.pools["prefill"].reason


def test_fresh_metrics_give_a_message_that_does_not_change_every_interval() -> None:
    sizes = {"prefill": 2, "decode": 2}
    first = decide(disaggregated(), signals(0.0, calm_prefill(2), calm_decode(2)), sizes,
                   PolicyState(), 0.0)  # fmt: skip
    later = decide(disaggregated(), signals(10.0, calm_prefill(2), calm_decode(2)), sizes,
                   first.state, 14.0)  # fmt: skip
    assert first.metrics_message == later.metrics_message


def test_a_rising_ask_is_carried_on_over_one_start_up() -> None:
    """Asks of 4, then 6 a start-up later: the replicas asked for now serve when the pool
    needs 8, so 8 is asked for and remembered (the next interval does not undo it)."""
    config = disaggregated(max_step=8, startup_s=60.0, scale_down_stabilization_s=300.0)
    first = signals(0.0, calm_prefill(4, busy=0.75), calm_decode(2))
    state = decide(config, first, {"prefill": 4, "decode": 2}, PolicyState(), 0.0).state
    rising = signals(60.0, calm_prefill(4, busy=1.1), calm_decode(2))
    decision = decide(config, rising, {"prefill": 4, "decode": 2}, state, 60.0)
    assert decision.pools["prefill"].desired == 8
    assert "rising to 8 by the time replicas load" in decision.pools["prefill"].reason
    steady = signals(75.0, calm_prefill(4, busy=1.1), calm_decode(2))
    later = decide(config, steady, {"prefill": 8, "decode": 2}, decision.state, 75.0)
    assert later.pools["prefill"].desired == 8


def test_the_forecast_never_reaches_past_max_replicas() -> None:
    """Asks of 4, then 5: the forecast (6) stops at maxReplicas 5, so the pool is not reported
    as limited by a guess."""
    config = disaggregated(
        pools={"prefill": PoolLimits(1, 5, 1), "decode": PoolLimits(1, 10, 1)}, startup_s=60.0
    )
    first = signals(0.0, calm_prefill(4, busy=0.75), calm_decode(2))
    state = decide(config, first, {"prefill": 4, "decode": 2}, PolicyState(), 0.0).state
    rising = signals(30.0, calm_prefill(4, busy=0.9), calm_decode(2))
    decision = decide(config, rising, {"prefill": 4, "decode": 2}, state, 30.0)
    assert decision.pools["prefill"].desired == 5
    assert "rising" not in decision.pools["prefill"].reason
    assert decision.pools["prefill"].limited is None and decision.scaling_limited is None


def worked_example_prefill(t: float, n: int) -> tuple[PoolSignals, float]:
    """docs/autoscaling.md's example: (prefill signals, TTFT) at time t on n replicas."""
    if t == 0:
        return PoolSignals(reporting=4, busy_fraction=0.7, prompt_tokens_per_s=28000,
                           prefill_backlog_tokens=2000), 0.35  # fmt: skip
    if t < 90:  # the rate more than doubled at 15 s; the new replicas load until 90 s
        return PoolSignals(reporting=4, busy_fraction=1.0, prompt_tokens_per_s=40000,
                           prefill_backlog_tokens=600_000, waiting=40), 1.9  # fmt: skip
    if t < 600:  # the new load: 6.64 replicas' worth of prefill
        return PoolSignals(reporting=n, busy_fraction=6.64 / n), 0.4
    return PoolSignals(reporting=n, busy_fraction=2.7 / n), 0.3  # the burst is over


def test_the_worked_example_in_the_docs() -> None:
    config = disaggregated(
        pools={"prefill": PoolLimits(1, 20, 1), "decode": PoolLimits(1, 20, 1)},
        ttft_s=0.8, max_step=4, kv_cache_target=0.7, startup_s=60.0,
    )  # fmt: skip
    state, current, changes = PolicyState(), {"prefill": 4, "decode": 3}, {}
    for i in range(90):
        now = i * INTERVAL
        prefill, ttft = worked_example_prefill(now, current["prefill"])
        decode = PoolSignals(reporting=3, kv_usage_sum=1.65, running=30.0, waiting=0.0)
        decision = decide(config, signals(now, prefill, decode, ttft=ttft, tpot=0.038),
                          current, state, now)  # fmt: skip
        assert not decision.pools["decode"].changed, decision.pools["decode"].reason
        pool = decision.pools["prefill"]
        if pool.changed:
            changes[now] = pool.reason
        state, current = decision.state, {r: d.desired for r, d in decision.pools.items()}
    assert changes[15.0] == (
        "prefill 4->8: prompt backlog 15.0 s > 0.40 s, rising to 12 by the time replicas load"
        " (TTFT p90 1900 ms, target 800 ms)"
    )
    assert 30.0 not in changes  # asks 8 again, which it has
    assert changes[90.0].startswith("prefill 8->10: busy 0.83 > target 0.80, rising to 10")
    assert changes[165.0].startswith(
        "prefill 10->9: busy 0.66 <= target 0.80; no ask above 9 for 300 s"
    )
    tail = {t: r.split(":")[0] for t, r in changes.items() if t > 600}
    assert tail == {
        960.0: "prefill 9->8", 1020.0: "prefill 8->7", 1095.0: "prefill 7->6",
        1155.0: "prefill 6->5", 1185.0: "prefill 5->4",
    }  # fmt: skip
    assert len(changes) == 3 + len(tail)
    assert changes[960.0].startswith(
        "prefill 9->8: busy 0.30 <= target 0.80; no ask above 4 for 300 s, older asks still hold 8"
    )
    assert "older asks" not in changes[1185.0]  # 4 is what the window's asks say


def test_a_backlog_allowance_under_10_ms_is_said_in_milliseconds() -> None:
    from phasefleet.autoscale.demand import Targets, backlog_term

    pool = PoolSignals(
        reporting=1, busy_fraction=1.0, prefill_backlog_tokens=400, prompt_tokens_per_s=2000
    )
    tight = backlog_term(pool, Targets(0.001, None, 0.9, 0.7), window_s=15.0)
    assert tight is not None and tight.sentence == "prompt backlog 0.2 s > 0.5 ms"
    loose = backlog_term(pool, Targets(0.1, None, 0.9, 0.7), window_s=15.0)
    assert loose is not None and loose.sentence == "prompt backlog 0.2 s > 0.05 s"


def test_an_on_off_pool_keeps_headroom_over_its_peak_ask_through_the_down_window() -> None:
    """Burst memory: once a pool's asks fall to a tenth of their peak (on/off load), the peak
    ask times peakHeadroom holds it, until the down window has passed."""
    config = disaggregated(peak_headroom=1.5, max_step=20, pools={
        "prefill": PoolLimits(1, 40, 1), "decode": PoolLimits(1, 10, 1),
    })  # fmt: skip
    sizes = {"prefill": 10, "decode": 2}
    hot = PoolSignals(reporting=10, busy_fraction=1.0, prefill_backlog_tokens=0.0)
    burst = decide(config, signals(0.0, hot, calm_decode(2), ttft=2.0), sizes, PolicyState(), 0.0)
    peak = burst.pools["prefill"].desired
    assert peak >= 10 and "x 1.5" not in burst.pools["prefill"].reason  # one ask: not on/off
    state, sizes = burst.state, {"prefill": peak, "decode": 2}
    silent = signals(INTERVAL, calm_prefill(peak, busy=0.0), calm_decode(2))
    decision = decide(config, silent, sizes, state, INTERVAL)
    held = math.floor(peak * 1.5 + 0.5)
    assert decision.pools["prefill"].desired == held
    assert f"peak ask {peak} over 300 s x 1.5 (on/off load)" in decision.pools["prefill"].reason
    state, sizes = decision.state, {"prefill": held, "decode": 2}
    now = INTERVAL
    while now < WINDOW - INTERVAL:  # silent, within the window: the headroom holds
        now += INTERVAL
        quiet = signals(now, calm_prefill(held, busy=0.0), calm_decode(2))
        decision = decide(config, quiet, sizes, state, now)
        state = decision.state
        assert decision.pools["prefill"].desired == held, now
    for _ in range(3 * int(WINDOW / INTERVAL)):  # then it lets go, as before
        now += INTERVAL
        quiet = signals(now, calm_prefill(sizes["prefill"], busy=0.0), calm_decode(2))
        decision = decide(config, quiet, sizes, state, now)
        state, sizes = decision.state, {p: d.desired for p, d in decision.pools.items()}
    assert sizes["prefill"] < peak


def test_a_steady_pool_keeps_its_peak_ask_without_headroom() -> None:
    """Asks that never fall to a tenth of their peak are steady load: the memory holds the
    peak ask itself, whatever peakHeadroom says (room there costs GPU-hours and bought no
    attainment in the replay)."""
    config = disaggregated(peak_headroom=1.5, max_step=20, pools={
        "prefill": PoolLimits(1, 40, 1), "decode": PoolLimits(1, 10, 1),
    })  # fmt: skip
    state, sizes = PolicyState(), {"prefill": 8, "decode": 2}
    for k, busy in enumerate((0.75, 0.5, 0.5, 0.6, 0.5)):  # asks 8, 6, 6, 7, 6
        now = k * INTERVAL
        reading = signals(now, calm_prefill(sizes["prefill"], busy=busy), calm_decode(2))
        decision = decide(config, reading, sizes, state, now)
        state, sizes = decision.state, {p: d.desired for p, d in decision.pools.items()}
    assert sizes["prefill"] == 8  # the peak ask, not 12
    assert "x 1 (steady load)" in decision.pools["prefill"].reason


def test_headroom_rounds_to_the_nearest_replica_and_one_means_none() -> None:
    from phasefleet.autoscale.policy import _peak_floor

    on_off = ((0.0, 7), (10.0, 0), (20.0, 5))
    assert _peak_floor(disaggregated(peak_headroom=1.0), on_off) == 7
    assert _peak_floor(disaggregated(peak_headroom=1.2), on_off) == 8  # 8.4
    assert _peak_floor(disaggregated(peak_headroom=1.5), ((0.0, 1), (5.0, 0))) == 1  # not 2
    assert _peak_floor(disaggregated(peak_headroom=1.5), ((0.0, 3), (5.0, 0))) == 5  # 4.5
    assert _peak_floor(disaggregated(peak_headroom=1.2), ((0.0, 2), (5.0, 0))) == 2  # 2.4
    assert _peak_floor(disaggregated(peak_headroom=1.5), ((0.0, 10), (5.0, 1))) == 15
    assert _peak_floor(disaggregated(peak_headroom=1.5), ((0.0, 10), (5.0, 2))) == 10  # steady
    assert _peak_floor(disaggregated(peak_headroom=1.5), ()) == 0


def test_load_rising_from_silence_is_not_on_off_until_it_falls() -> None:
    """Low asks before the peak (a new service's first requests, or the first decision after a
    restart, before any arrived) are a rise, not bursts: no headroom until the asks fall to a
    tenth of an earlier peak."""
    from phasefleet.autoscale.policy import _on_off, _peak_floor

    rise = ((0.0, 1), (5.0, 10), (10.0, 10), (15.0, 8))
    assert not _on_off(rise)
    assert _peak_floor(disaggregated(peak_headroom=1.5), rise) == 10
    fallen = (*rise, (20.0, 1))
    assert _on_off(fallen)
    assert _peak_floor(disaggregated(peak_headroom=1.5), fallen) == 15
    assert not _on_off(((0.0, 0), (5.0, 0)))  # silence throughout: no peak to fall from
    assert _on_off(((0.0, 4), (5.0, 40), (10.0, 4)))  # a tenth of the peak, not of the first

    config = disaggregated(peak_headroom=1.5, max_step=20, pools={
        "prefill": PoolLimits(1, 40, 1), "decode": PoolLimits(1, 10, 1),
    })  # fmt: skip
    state, sizes = PolicyState(), {"prefill": 8, "decode": 2}
    for k, busy in enumerate((0.0, 0.75, 0.75, 0.6)):  # asks 1 (nothing yet), 8, 8, 6
        now = k * INTERVAL
        reading = signals(now, calm_prefill(sizes["prefill"], busy=busy), calm_decode(2))
        decision = decide(config, reading, sizes, state, now)
        state, sizes = decision.state, {p: d.desired for p, d in decision.pools.items()}
    assert sizes["prefill"] == 8, decision.pools["prefill"].reason  # not 12
    assert "x 1 (steady load)" in decision.pools["prefill"].reason


def test_a_hold_is_not_a_peak_so_headroom_never_feeds_on_itself() -> None:
    """With no load signal the ask is the pool's own size: kept as a peak, x1.2 would grow
    the pool every decision up to maxReplicas."""
    config = disaggregated(peak_headroom=1.2)
    state, sizes = PolicyState(), {"prefill": 5, "decode": 5}
    silent = PoolSignals(reporting=5)
    for k in range(10):
        quiet = Signals(k * INTERVAL, INTERVAL, {"prefill": silent, "decode": silent})
        decision = decide(config, quiet, sizes, state, k * INTERVAL)
        state = decision.state
        assert {p: d.desired for p, d in decision.pools.items()} == sizes, k
        assert "no load signal" in decision.pools["prefill"].reason


def test_decode_peaks_ask_for_the_burst_a_snapshot_missed() -> None:
    """The peak gauges: a decode pool whose caches and batch slots filled between two samples
    is sized for that peak at its own targets (0.85 of the KV cache, 0.9 of the slots), not
    for the calm snapshot."""
    from phasefleet.autoscale.demand import Targets, kv_term, slots_term

    targets = Targets(None, None, 0.9, 0.7)
    calm = PoolSignals(reporting=4, kv_usage_sum=1.2, running=8.0, waiting=0.0)
    kv, slots = kv_term(calm, targets), slots_term(calm, 16)
    assert kv is not None and kv.replicas == 2 and slots is not None and slots.replicas == 1
    burst = replace(calm, kv_usage_peak_sum=3.4, requests_peak=60.0)
    kv, slots = kv_term(burst, targets), slots_term(burst, 16)
    assert kv is not None and kv.replicas == 4  # ceil(3.4 / 0.85)
    assert kv.sentence == "KV usage peak 0.85 <= target 0.85"
    assert slots is not None and slots.replicas == 5  # ceil(60 / (16 x 0.9))
    assert slots.sentence == "batch slots peak 0.94 > target 0.90"
    below = replace(calm, kv_usage_peak_sum=1.3, requests_peak=9.0)  # the snapshot asks more
    kv = kv_term(below, targets)
    assert kv is not None and kv.replicas == 2 and kv.sentence.startswith("KV usage 0.30")
    loose = kv_term(burst, Targets(None, None, 0.9, 0.9))  # kvCacheTarget above 0.85 rules
    assert loose is not None and loose.replicas == 4 and "target 0.90" in loose.sentence
