"""The autoscaling simulator (bench/autoscale_sim.py) and its controllers on small hand-made
traces whose answers can be worked out by hand."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from autoscale_curves import h100_8b
from autoscale_observe import Observer
from autoscale_policies import Hpa, demand, held, oracle, oracle_sizes, ours, static
from autoscale_traces import add_spike, code_lengths, compress_bursts, on_off, scale_rate

from phasefleet.autoscale.policy import PoolLimits, ScalingConfig
from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import Fleet, simulate
from phasefleet.plan.trace import Trace

STEP_S = 0.01  # decode step, whatever the batch


def make_curves(
    kv_capacity: int = 100_000, max_num_seqs: int = 8, startup_s: float = 5.0
) -> Curves:
    return Curves(
        name="test",
        prefill=(0.0, 0.001, 0.0),  # 1 ms per prompt token
        decode=(STEP_S, 0.0, 0.0),
        kv_capacity_tokens=kv_capacity,
        max_num_seqs=max_num_seqs,
        startup_s=startup_s,
        handoff_bytes_per_s=1e12,
        kv_bytes_per_token=1,  # hand-off of n tokens: n picoseconds, i.e. nothing
    )


def make_trace(arrivals: list[float], prompt: int = 100, output: int = 11) -> Trace:
    n = len(arrivals)
    return Trace("t", np.array(arrivals), np.full(n, prompt), np.full(n, output))


def fixed(sizes: Mapping[str, int]) -> Mapping[str, int]:
    return dict(sizes)


def test_prefill_is_first_come_first_served_and_sets_ttft() -> None:
    trace = make_trace([0.0, 0.0, 0.05])
    fleet = simulate(
        trace,
        make_curves(),
        static({"prefill": 1, "decode": 1}),
        fixed({"prefill": 1, "decode": 1}),
    )
    ttft = fleet.first_token - trace.arrival
    # 100-token prompts take 0.1 s each, one after another on the one replica
    np.testing.assert_allclose(ttft, [0.1, 0.2, 0.25], atol=1e-9)


def test_decode_takes_one_step_per_token_after_the_first() -> None:
    trace = make_trace([0.0], output=11)
    fleet = simulate(
        trace,
        make_curves(),
        static({"prefill": 1, "decode": 1}),
        fixed({"prefill": 1, "decode": 1}),
    )
    tpot = (fleet.finish[0] - fleet.first_token[0]) / 10
    assert tpot == pytest.approx(STEP_S, rel=0.01)
    assert fleet.end == pytest.approx(fleet.finish[0])


def test_a_request_that_does_not_fit_the_kv_cache_waits_and_its_tpot_shows_it() -> None:
    # capacity for one request's final size (100 + 11) only: the second waits for the first
    trace = make_trace([0.0, 0.0])
    fleet = simulate(
        trace,
        make_curves(kv_capacity=150),
        static({"prefill": 2, "decode": 1}),
        fixed({"prefill": 2, "decode": 1}),
    )
    assert fleet.finish[1] >= fleet.finish[0] + 10 * STEP_S * 0.99
    tpot = (fleet.finish - fleet.first_token) / 10
    assert tpot[1] > 1.8 * tpot[0]


def test_a_full_kv_cache_preempts_the_newest_request_and_it_still_finishes() -> None:
    trace = make_trace([0.0, 0.0], output=101)  # 200 tokens at first, 400 at the end
    pools = {"prefill": 2, "decode": 1}
    fleet = simulate(trace, make_curves(kv_capacity=250), static(pools), fixed(pools))
    assert fleet.preemptions >= 1
    assert not np.isnan(fleet.finish).any()
    preempted = int(np.argmax(fleet.generated_before))
    assert fleet.generated_before[preempted] > 0  # it kept the tokens it had made
    tpot = (fleet.finish - fleet.first_token) / 100
    assert tpot[preempted] > tpot[1 - preempted] * 1.2


def test_max_num_seqs_limits_the_batch() -> None:
    trace = make_trace([0.0] * 4)
    fleet = simulate(
        trace,
        make_curves(max_num_seqs=2),
        static({"prefill": 4, "decode": 1}),
        fixed({"prefill": 4, "decode": 1}),
    )
    finish = np.sort(fleet.finish)
    assert finish[2] - finish[1] == pytest.approx(10 * STEP_S, abs=0.06)  # a second round


def test_a_new_replica_serves_only_after_start_up_and_its_loading_counts_as_gpu_time() -> None:
    trace = make_trace([1.0, 1.0, 6.0, 6.0])
    sizes = {"prefill": 2, "decode": 1}
    fleet = simulate(
        trace, make_curves(startup_s=5.0), static(sizes), fixed({"prefill": 1, "decode": 1})
    )
    ttft = fleet.first_token - trace.arrival
    np.testing.assert_allclose(ttft, [0.1, 0.2, 0.1, 0.1], atol=1e-9)  # the 2nd serves from 5 s
    # from 0 to the end: 2 prefill replicas (one asked at 0, loading 5 s) and 1 decode
    assert fleet.gpu_seconds(fleet.end) == pytest.approx(3 * fleet.end)


def test_scale_down_drains_no_request_is_lost_and_the_drained_replica_stops() -> None:
    trace = make_trace(list(np.linspace(0, 20, 200)), output=300)

    def shrink(fleet: Fleet, now: float) -> Mapping[str, int]:
        return {"prefill": 1, "decode": 3 if now < 5 else 1}

    fleet = simulate(trace, make_curves(), shrink, {"prefill": 1, "decode": 3}, interval_s=5.0)
    assert not np.isnan(fleet.finish).any()
    stopped = [r for r in fleet.retired if r.draining]
    assert len(stopped) == 2
    assert all(r.stopped is not None and r.stopped > 5.0 for r in stopped)
    assert fleet.gpu_seconds(fleet.end) < 3 * fleet.end


def test_observer_reports_prefill_backlog_and_serving_replicas() -> None:
    trace = make_trace([0.0] * 10, prompt=1000)  # 10 s of prefill on one replica
    seen = {}

    def look(fleet: Fleet, now: float) -> Mapping[str, int]:
        if now == pytest.approx(5.0):
            seen["s"] = Observer(window_s=5.0, percentile=0.9).signals(fleet, now)
        return {"prefill": 1, "decode": 1}

    simulate(trace, make_curves(), look, {"prefill": 1, "decode": 1}, interval_s=5.0)
    pool = seen["s"].pools["prefill"]
    assert pool.reporting == 1
    # at 5 s five prompts are done, the sixth has just started and four wait
    assert pool.prefill_backlog_tokens == 5000
    assert pool.busy_fraction == pytest.approx(1.0)
    assert pool.waiting == 4 and pool.running == 1


def hpa_of(metric: float, ready: int) -> Hpa:
    return Hpa(
        {p: (lambda fleet, now: (metric * ready, ready)) for p in ("prefill", "decode")},
        {"prefill": 0.5, "decode": 0.5},
    )


def test_hpa_keeps_its_size_within_the_tolerance_and_doubles_at_most_per_period() -> None:
    fleet = Fleet(make_trace([0.0]), make_curves(), {"prefill": 4, "decode": 4}, 0.05)
    assert hpa_of(0.52, 4)(fleet, 0.0)["prefill"] == 4  # 4% over target: within 10%
    assert hpa_of(5.0, 4)(fleet, 0.0)["prefill"] == 8  # asks 40, gets max(4 + 4, 2 x 4)


def test_hpa_scales_down_only_to_the_highest_ask_of_the_last_300_s() -> None:
    fleet = Fleet(make_trace([0.0]), make_curves(), {"prefill": 4, "decode": 4}, 0.05)
    hpa = hpa_of(0.5, 4)
    hpa(fleet, 0.0)
    hpa.metric = hpa_of(0.1, 4).metric
    assert hpa(fleet, 100.0)["prefill"] == 4  # the ask of 4 at 0 s is inside the window
    assert hpa(fleet, 301.0)["prefill"] == 1


def test_oracle_sizes_follow_the_work_and_start_replicas_ahead() -> None:
    curves = make_curves()
    arrivals = list(np.linspace(120, 179, 540))  # 540 x 0.1 s of prefill in the third minute
    sizes = oracle_sizes(
        demand(make_trace(arrivals), curves), curves, {"prefill": 0.5, "decode": 0.5}
    )
    assert list(sizes["prefill"][:4]) == [1, 1, 2, 1]  # 54 s of work at 50% in 60 s
    control = oracle(sizes, 60.0, lead_s=curves.startup_s + 15)
    fleet = Fleet(make_trace([0.0]), curves, {"prefill": 1, "decode": 1}, 0.05)
    assert control(fleet, 100.0)["prefill"] == 2  # 120 s is within 20 s
    assert control(fleet, 90.0)["prefill"] == 1


def test_our_policy_in_the_loop_grows_the_prefill_pool_under_a_ramp() -> None:
    arrivals = list(np.sort(np.random.default_rng(0).uniform(0, 600, 6000)))
    trace = make_trace(arrivals, prompt=300)  # 10 req/s x 0.3 s: 3 replicas busy
    limits = PoolLimits(1, 16, 1)
    config = ScalingConfig(
        {"prefill": limits, "decode": limits}, ttft_s=1.0, tpot_s=0.05, startup_s=5.0
    )
    log: list[str] = []
    fleet = simulate(
        trace,
        make_curves(max_num_seqs=64),
        ours(config, log),
        {"prefill": 1, "decode": 1},
        interval_s=config.interval_s,
    )
    assert max(s.asked["prefill"] for s in fleet.samples) >= 4
    late = trace.arrival > 300  # after the policy caught up: TTFT within its target
    assert np.quantile((fleet.first_token - trace.arrival)[late], 0.9) <= 1.0
    assert any(line.strip().split(" ", 1)[1].startswith("prefill 1->") for line in log)


def test_scale_rate_keeps_the_shape_and_variants_add_what_they_say() -> None:
    rng = np.random.default_rng(0)
    base = make_trace(list(np.sort(rng.uniform(0, 600, 1000))))
    doubled = scale_rate(base, 2.5)
    assert len(doubled.arrival) == pytest.approx(2500, rel=0.05)
    per_min = np.bincount((base.arrival // 60).astype(int))
    per_min_scaled = np.bincount((doubled.arrival // 60).astype(int), minlength=len(per_min))
    np.testing.assert_allclose(per_min_scaled[:10] / per_min, 2.5, rtol=0.2)
    spiked = add_spike(base, at_s=300.0, length_s=60.0, times=10.0)
    inside = ((base.arrival >= 300) & (base.arrival < 360)).sum()
    assert len(spiked.arrival) - len(base.arrival) == 9 * inside
    squeezed = compress_bursts(base, block_s=120.0, squeeze=4.0)
    assert ((squeezed.arrival % 120) < 30).all() and len(squeezed.arrival) == 1000


def test_on_off_bursts_keep_every_request_and_peak_4_to_10x_the_cycle_mean() -> None:
    rng = np.random.default_rng(0)
    base = make_trace(list(np.sort(rng.uniform(0, 3600, 20_000))))
    bursty = on_off(base, seed=3)
    assert len(bursty.arrival) == 20_000 and (np.diff(bursty.arrival) >= 0).all()
    np.testing.assert_array_equal(bursty.prompt, base.prompt)
    per_10s = np.bincount((bursty.arrival // 10).astype(int))
    mean = 20_000 / 360
    assert 3.0 * mean < per_10s.max() < 11.0 * mean  # on: 4-10x the mean rate
    assert (per_10s == 0).mean() > 0.5  # off most of the time
    np.testing.assert_array_equal(on_off(base, seed=3).arrival, bursty.arrival)  # seeded
    assert not np.array_equal(on_off(base, seed=4).arrival, bursty.arrival)


def test_code_lengths_are_long_prompts_with_short_answers() -> None:
    base = make_trace([float(t) for t in range(200)])
    donor = Trace("d", np.zeros(4), np.array([200, 2000, 4000, 9000]), np.array([5, 5, 5, 5]))
    code = code_lengths(base, donor, seed=1)  # prompts of 1000-8192 tokens only
    assert set(code.prompt) == {2000, 4000}
    assert code.output.min() >= 1 and code.output.max() <= 30
    np.testing.assert_array_equal(code.arrival, base.arrival)


def test_h100_curves_follow_the_roofline() -> None:
    c = h100_8b()
    assert c.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert 350_000 < c.kv_capacity_tokens < 450_000  # ~52 GB free of 72 GB after 16 GB weights
    assert c.decode_step_s(1, 0) == pytest.approx(0.004 + 16.06e9 / (3.35e12 * 0.8), rel=0.01)
    assert c.prefill_s(8192) > 8192 * 2 * 8.03e9 / 989e12  # no faster than peak FLOP/s


def test_the_held_oracle_keeps_each_size_through_the_scale_down_window() -> None:
    sizes = {"prefill": np.array([1, 5, 1, 1, 1, 1, 1, 2]), "decode": np.array([3, 1, 1])}
    out = held(sizes, window_s=300.0, interval_s=60.0)  # a size stays 4 more minutes
    assert list(out["prefill"]) == [1, 5, 5, 5, 5, 5, 1, 2]
    assert list(out["decode"]) == [3, 3, 3]
    assert list(held(sizes, window_s=60.0, interval_s=60.0)["prefill"]) == list(sizes["prefill"])


def test_a_streamed_hand_off_leaves_the_last_chunk_or_the_links_backlog() -> None:
    """Prefill at 1 ms per token, chunks of 100 tokens. A fast link (0.5 ms per token) carries
    each chunk while the next is computed: the last chunk's 50 ms remain after the first token.
    A slow link (2 ms per token) falls behind: the backlog remains. Pulled: all of it."""
    from dataclasses import replace

    fast = replace(make_curves(), kv_bytes_per_token=500_000_000, chunk_tokens=100)
    assert fast.handoff_s(300) == pytest.approx(0.05)
    assert fast.handoff_s(80) == pytest.approx(0.04)  # one chunk: nothing overlaps
    slow = replace(fast, kv_bytes_per_token=2_000_000_000)
    # chunk k is computed by 0.1 k s; the link sends 0.2 s per chunk from 0.1 s: done at 0.7 s
    assert slow.handoff_s(300) == pytest.approx(0.4)
    assert replace(fast, streamed=False).handoff_s(300) == pytest.approx(0.15)
    trace = make_trace([0.0], prompt=300, output=2)
    one = {"prefill": 1, "decode": 1}
    fleet = simulate(trace, fast, static(one), fixed(one))
    # first token at 0.3 s; the decode starts 0.05 s later and takes one step
    assert fleet.finish[0] - fleet.first_token[0] == pytest.approx(0.05 + STEP_S, abs=0.02)
    held_fleet = simulate(
        trace, replace(fast, first_token_waits_for_kv=True), static(one), fixed(one)
    )
    assert held_fleet.first_token[0] == pytest.approx(0.35)  # token 1 held until the KV landed


def test_layer_groups_send_a_chunk_during_its_own_forward_pass() -> None:
    """One chunk of 80 tokens, computed in 80 ms, its KV 40 ms on the link: in 4 layer groups
    the first three quarters go while the pass goes on, and only the last quarter (10 ms) is
    left after the first token; on a slow link (160 ms) the backlog stays."""
    from dataclasses import replace

    fast = replace(make_curves(), kv_bytes_per_token=500_000_000, chunk_tokens=100)
    assert replace(fast, layer_groups=4).handoff_s(80) == pytest.approx(0.01)
    assert replace(fast, layer_groups=1).handoff_s(80) == pytest.approx(0.04)
    slow = replace(fast, kv_bytes_per_token=2_000_000_000, layer_groups=4)
    # groups ready at 20, 40, 60, 80 ms, 40 ms each on the link: done at 180 ms
    assert slow.handoff_s(80) == pytest.approx(0.1)
