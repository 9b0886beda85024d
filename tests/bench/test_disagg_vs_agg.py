"""bench/disagg_vs_agg.py: goodput at a target attainment, the setups, and a small sweep of
both fleets."""

from __future__ import annotations

import numpy as np
import pytest
from autoscale_replay import Slo
from disagg_vs_agg import RATE_STEP, Replay, best, goodput, setups, sweep

from phasefleet.plan.curves import Curves
from phasefleet.plan.trace import Trace


def test_goodput_is_the_rate_where_attainment_crosses_the_target() -> None:
    rates = np.array([1.0, 2.0, 4.0, 8.0])
    # passes at 2, misses at 4: 0.98 -> 0.78 crosses 0.9 two fifths of the way
    assert goodput(rates, np.array([1.0, 0.98, 0.78, 0.2]), 0.9) == pytest.approx(2.8)
    assert goodput(rates, np.array([0.5, 0.4, 0.3, 0.2]), 0.9) == 0.0
    assert goodput(rates, np.array([1.0, 1.0, 0.95, 0.91]), 0.9) == 8.0
    # a miss at a low rate (a small sample) does not hide the passes above it
    assert goodput(rates, np.array([0.85, 0.95, 0.7, np.nan]), 0.9) == pytest.approx(2.4)
    assert goodput(rates, np.array([1.0, 0.95, np.nan, np.nan]), 0.9) == 2.0


def test_setups_split_the_same_gpus_every_way() -> None:
    runs = setups((512,), 131072, 4)
    assert [s.name for s in runs] == [
        "agg unchunked",
        "agg chunk 512",
        "disagg 1P:3D",
        "disagg 2P:2D",
        "disagg 3P:1D",
    ]
    assert all(s.gpus == 4 for s in runs)
    assert all(s.prefill + s.decode == 4 for s in runs if not s.aggregated)


def test_a_sweep_raises_the_rate_until_every_setup_misses() -> None:
    curves = Curves(
        name="test",
        prefill=(0.002, 0.001, 0.0),
        decode=(0.01, 0.0001, 0.0),
        kv_capacity_tokens=100_000,
        max_num_seqs=32,
        startup_s=0.0,
        handoff_bytes_per_s=1e12,
        kv_bytes_per_token=1,
    )
    rng = np.random.default_rng(0)
    n = 200
    trace = Trace(
        "t", np.sort(rng.uniform(0, 60, n)), rng.integers(50, 300, n), rng.integers(2, 50, n)
    )
    runs = setups((128,), 4096, 2)
    replay = Replay(trace, curves, curves, (Slo(0.5, 0.02), Slo(0.5, 0.05)))
    sw = sweep(replay, runs, 0.9)
    for s, a in sw.attained.items():
        assert a[1, 0] >= 0.9, s.name  # the lowest rate is easy
        ran = a[1][~np.isnan(a[1])]
        assert (ran[-2:] < 0.9).all(), s.name  # and each ran until it missed twice
        assert (a[0][: len(ran)] <= a[1][: len(ran)]).all()  # the tighter TPOT, no more met
    # the refined best lies between the grid's last rate that meets the target and the next
    for aggregated in (True, False):
        top = best(replay, sw, aggregated, 1, 0.9)
        assert top.setup is not None and top.setup.aggregated == aggregated
        a = sw.attained[top.setup][1]
        k = int(np.flatnonzero(a >= 0.9)[-1])
        assert sw.rates[k] <= top.goodput < sw.rates[k] * RATE_STEP
        assert replay.attainment(top.setup, top.goodput)[1] >= 0.9
