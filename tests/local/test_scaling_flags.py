"""`phasefleet serve`'s autoscaling flags: pool bounds, starting sizes, the policy's config, and
errors that name the flag."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from phasefleet.autoscale.policy import PoolLimits
from phasefleet.cli import build_parser
from phasefleet.local.scaling_flags import hold_args, late_after, pool_sizes, scaling_config

DISAGGREGATED = ["prefill", "decode"]


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--model", "tiny", *flags])


def test_defaults_start_each_pool_at_its_min_and_let_it_grow_to_four() -> None:
    args = parse("--autoscale")
    sizes, bounds = pool_sizes(args, DISAGGREGATED)
    assert sizes == {"prefill": 1, "decode": 1}
    assert bounds == {"prefill": (1, 4), "decode": (1, 4)}
    config = scaling_config(args, bounds, startup_s=12.5)
    assert config.pools == {"prefill": PoolLimits(1, 4), "decode": PoolLimits(1, 4)}
    assert (config.ttft_s, config.tpot_s, config.percentile, config.kv_cache_target) == (
        None, None, 0.9, 0.7,
    )  # fmt: skip
    assert (config.interval_s, config.signal_window_s) == (5, 30)
    assert (config.scale_down_stabilization_s, config.max_step) == (300, 1)
    assert config.startup_s == 12.5


def test_flags_reach_the_policy_config() -> None:
    args = parse(
        "--autoscale", "--prefill", "2", "--min", "prefill=2", "--max", "prefill=6",
        "--max", "decode=3", "--ttft-ms", "400", "--tpot-ms", "40", "--percentile", "0.95",
        "--kv-cache-target", "0.8", "--interval", "2.5", "--signal-window", "10",
        "--scale-down-window", "60",
        "--max-step", "3", "--peak-headroom", "1.2",
    )  # fmt: skip
    sizes, bounds = pool_sizes(args, DISAGGREGATED)
    assert sizes == {"prefill": 2, "decode": 1}
    config = scaling_config(args, bounds, startup_s=8.0)
    assert config.pools == {"prefill": PoolLimits(2, 6), "decode": PoolLimits(1, 3)}
    assert (config.ttft_s, config.tpot_s, config.percentile, config.kv_cache_target) == (
        0.4, 0.04, 0.95, 0.8,
    )  # fmt: skip
    assert (config.interval_s, config.signal_window_s) == (2.5, 10)
    assert (config.scale_down_stabilization_s, config.max_step) == (60, 3)
    assert config.peak_headroom == 1.2
    assert scaling_config(parse("--autoscale"), bounds, startup_s=8.0).peak_headroom == 1.5
    slow = scaling_config(parse("--autoscale", "--interval", "60"), bounds, startup_s=8.0)
    assert slow.signal_window_s == 120  # unset: 30 s, or two intervals when that is longer


def test_pools_with_min_zero_start_with_one_worker_and_the_router_holds() -> None:
    args = parse(
        "--autoscale", "--min", "decode=0", "--min", "prefill=0", "--scale-to-zero-after", "90"
    )
    sizes, bounds = pool_sizes(args, DISAGGREGATED)
    assert sizes == {"prefill": 1, "decode": 1}  # the first workers measure the load time
    assert bounds == {"prefill": (0, 4), "decode": (0, 4)}
    assert scaling_config(args, bounds, startup_s=5.0).scale_to_zero_after_s == 90
    assert hold_args(bounds) == ["--hold-seconds", "120", "--max-held-requests", "256"]
    assert hold_args({"prefill": (1, 4), "decode": (1, 4)}) == []
    defaults = scaling_config(parse("--autoscale"), {"worker": (0, 1)}, startup_s=5.0)
    assert defaults.scale_to_zero_after_s == 600


def test_aggregated_fleet_has_one_pool_named_worker() -> None:
    args = parse("--aggregated", "--autoscale", "--workers", "3", "--max", "worker=5")
    assert pool_sizes(args, ["worker"]) == ({"worker": 3}, {"worker": (1, 5)})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min", "prefill=2"], "--min need --autoscale"),
        (["--autoscale", "--min", "prefill"], "--min: expected POOL=N with N a whole number"),
        (["--autoscale", "--max", "decode=-1"], "--max: expected POOL=N"),
        (["--autoscale", "--min", "worker=2"], "--min worker=2: no pool 'worker'"),
        (["--autoscale", "--max", "decode=0"], "--max decode=0: must be at least 1"),
        (["--autoscale", "--min", "decode=0", "--decode", "0"], "--decode 0: a pool starts"),
        (
            [
                "--autoscale",
                "--interval",
                "30",
                "--signal-window",
                "30",
                "--scale-to-zero-after",
                "10",
            ],
            "--scale-to-zero-after must be at least --interval, 30 s; got 10",
        ),
        (
            ["--autoscale", "--interval", "20", "--signal-window", "10"],
            "--signal-window must be at least --interval, 20 s; got 10",
        ),
        (["--autoscale", "--min", "decode=3", "--max", "decode=2"], "--max decode=2 is below"),
        (["--autoscale", "--prefill", "5", "--max", "prefill=4"], "--prefill 5 is outside"),
        (["--autoscale", "--percentile", "1.5"], "--percentile must be between 0.5 and 0.999"),
        (["--autoscale", "--kv-cache-target", "0"], "--kv-cache-target must be between"),
        (["--autoscale", "--ttft-ms", "0"], "--ttft-ms must be >= 1, got 0"),
        (["--autoscale", "--interval", "0"], "--interval must be > 0 seconds"),
        (["--autoscale", "--max-step", "0"], "--max-step must be >= 1"),
        (["--autoscale", "--peak-headroom", "0.9"], "--peak-headroom must be between 1 and 3"),
        (["--peak-headroom", "1.2"], "--peak-headroom need --autoscale"),
        (["--autoscale", "--scale-down-window", "-1"], "--scale-down-window must be >= 0"),
    ],
)
def test_bad_flags_are_named(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        pool_sizes(parse(*flags), DISAGGREGATED)


def test_serve_refuses_a_bad_flag_before_loading_anything(tiny_model: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "phasefleet.cli", "serve", "--model", str(tiny_model),
         "--autoscale", "--max", "prefill=x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "phasefleet serve: --max: expected POOL=N with N a whole number, got 'prefill=x'" in (
        out.stderr
    )


def test_the_ttft_target_serves_late_prompts_last_unless_turned_off() -> None:
    assert late_after(parse()) is None  # no target: first come, first served
    assert late_after(parse("--ttft-ms", "800")) == 800
    assert late_after(parse("--ttft-ms", "800", "--no-late-prompts-last")) is None
    assert late_after(parse("--ttft-ms", "300000")) is None  # past the late prompts' own limit
