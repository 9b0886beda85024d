"""bench/autoscale_bursts.py's per-burst rows on a hand-made trace whose misses can be counted
by hand."""

from __future__ import annotations

import json

import numpy as np
from autoscale_bursts import Case, burst_rows, shifted
from autoscale_policies import static
from autoscale_replay import SLOS

from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import simulate
from phasefleet.plan.trace import Trace


def make_curves() -> Curves:
    return Curves(
        name="test",
        prefill=(0.0, 0.001, 0.0),  # 1 ms per prompt token: 0.1 s per 100-token prompt
        decode=(0.01, 0.0, 0.0),
        kv_capacity_tokens=1_000_000,
        max_num_seqs=64,
        startup_s=5.0,
        handoff_bytes_per_s=1e12,
        kv_bytes_per_token=1,
    )


def test_each_burst_gets_a_row_with_its_need_and_the_requests_it_missed() -> None:
    # 10 prompts over 0.9 s, then, 30 s later, 30 over 0.97 s: on one prefill replica the
    # second burst's k-th prompt waits 0.1 + k x (0.1 - 1/30) s, over 1 s from k = 14
    first = np.arange(10) * 0.1
    second = 30.0 + np.arange(30) / 30
    n = 40
    trace = Trace("t", np.r_[first, second], np.full(n, 100), np.full(n, 11))
    sizes = {"prefill": 1, "decode": 1}
    curves = make_curves()
    fleet = simulate(trace, curves, static(sizes), sizes, dt=0.01)

    rows = [json.loads(r) for r in burst_rows(Case("t", trace), fleet, fleet, curves)]

    assert [r["n"] for r in rows] == [10, 30]
    assert [r["t"] for r in rows] == [0, 30]
    assert rows[0]["need"] == 1.0  # 1 s of prefill over its (at least 1 s) length
    assert rows[1]["need"] == 3.0 and rows[1]["prev_max_need"] == 1.0
    assert rows[0]["miss"] == 0
    assert rows[1]["miss"] == rows[1]["miss_ttft"] == rows[1]["ref_miss"] == 16
    assert rows[1]["ours_ready"] == rows[1]["ref_ready"] == 1


def test_a_shifted_case_keeps_its_requests_slo_and_kind_and_is_named_apart() -> None:
    trace = Trace("t", np.array([0.0, 2.0]), np.array([10, 20]), np.array([3, 4]))
    case = shifted(Case("mooncake_conversation", trace), 5.0)
    assert case.label == "mooncake_conversation+5s"
    assert list(case.trace.arrival) == [5.0, 7.0]
    assert list(case.trace.prompt) == [10, 20] and list(case.trace.output) == [3, 4]
    assert case.slo == SLOS["mooncake_conversation"] and not case.variant
    seeded = shifted(Case("onoff_chat_seed2", trace), 10.0)
    assert seeded.label == "onoff_chat_seed2+10s" and seeded.variant
    assert seeded.slo == SLOS["azure2023_conv"]
    assert shifted(case, 0.0) is case
