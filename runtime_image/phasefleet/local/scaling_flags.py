"""The flags of `phasefleet serve --autoscale` and the `ScalingConfig` they build.

They mirror the InferenceService's `slo`, `autoscaling` and per-pool `minReplicas`/`maxReplicas`,
with the same defaults, except the pool bounds: `--min` is 1 worker and `--max` is 4 (or the
pool's `--min` or starting size, if larger). A pool starts at its `--prefill`/`--decode`/
`--workers` count, or at its `--min` when that flag is not given (1 if `--min` is 0: the first
workers measure the model's load time; the pool idles to zero after `--scale-to-zero-after`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phasefleet.autoscale.policy import ScalingConfig

DEFAULT_MIN = 1  # workers per pool
DEFAULT_MAX = 4  # workers per pool
SIZE_FLAGS = {"prefill": "--prefill", "decode": "--decode", "worker": "--workers"}
SCALING_FLAGS = (
    "min", "max", "ttft_ms", "tpot_ms", "percentile", "kv_cache_target", "interval",
    "signal_window", "scale_down_window", "max_step", "peak_headroom", "scale_to_zero_after",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("autoscaling (as the InferenceService's slo and autoscaling)")
    group.add_argument(
        "--autoscale", action="store_true", help="size each pool to the SLO (see --min/--max)"
    )
    group.add_argument(
        "--min",
        action="append",
        metavar="POOL=N",
        help=f"a pool's fewest workers (default {DEFAULT_MIN})",
    )
    group.add_argument(
        "--max",
        action="append",
        metavar="POOL=N",
        help=f"a pool's most workers (default {DEFAULT_MAX})",
    )
    group.add_argument("--ttft-ms", type=int, help="time-to-first-token target (ms; default none)")
    group.add_argument(
        "--tpot-ms", type=int, help="time-per-output-token target (ms; default none)"
    )
    group.add_argument(
        "--late-prompts-last",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --ttft-ms, a prompt that has waited past it goes behind those that can still"
        " meet it, with or without --autoscale (runtime.latePromptsLast; default on)",
    )
    group.add_argument("--percentile", type=float, help="the targets' quantile (default 0.9)")
    group.add_argument(
        "--kv-cache-target", type=float, help="decode KV-cache usage to aim for (default 0.7)"
    )
    group.add_argument("--interval", type=float, help="seconds between decisions (default 5)")
    group.add_argument(
        "--signal-window",
        type=float,
        help="seconds the rates and latency quantiles cover (at least --interval; default 30, or"
        " two intervals if longer)",
    )
    group.add_argument(
        "--scale-down-window",
        type=float,
        help="seconds of lower recommendations before a pool shrinks (default 300)",
    )
    group.add_argument("--max-step", type=int, help="most workers added per decision (default 1)")
    group.add_argument(
        "--peak-headroom",
        type=float,
        help="a pool under on/off load keeps its peak ask over the scale-down window x this"
        " (burst memory; default 1.5, 1: no room)",
    )
    group.add_argument(
        "--scale-to-zero-after",
        type=float,
        help="seconds without requests before a pool with --min POOL=0 stops its last worker"
        " (default 600); the router holds requests while it wakes",
    )


def late_after(args: argparse.Namespace) -> int | None:
    """The router's --late-after-ms (sent with each request): the TTFT target, as the operator
    passes slo.ttftMs."""
    from phasefleet.api.contract import late_after_ms

    return late_after_ms(args.ttft_ms) if args.late_prompts_last else None


def _counts(flag: str, values: list[str] | None, pools: list[str], least: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values or []:
        pool, sep, number = value.partition("=")
        if not sep or not number.strip().isdigit():
            raise ValueError(f"{flag}: expected POOL=N with N a whole number, got {value!r}")
        if pool not in pools:
            raise ValueError(
                f"{flag} {value}: no pool {pool!r}; this fleet's pools: {', '.join(pools)}"
            )
        counts[pool] = int(number)
        if counts[pool] < least:
            raise ValueError(f"{flag} {value}: must be at least {least}")
    return counts


def pool_sizes(
    args: argparse.Namespace, pools: list[str]
) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """Each pool's starting size and, with --autoscale, its (min, max); ValueError names a flag."""
    given = {pool: getattr(args, SIZE_FLAGS[pool][2:]) for pool in pools}
    if not args.autoscale:
        unused = [
            f"--{name.replace('_', '-')}"
            for name in SCALING_FLAGS
            if getattr(args, name) is not None
        ]
        if unused:
            raise ValueError(f"{', '.join(unused)} need --autoscale")
        return {pool: 1 if n is None else n for pool, n in given.items()}, {}
    _check_knobs(args)
    lows, highs = _counts("--min", args.min, pools, 0), _counts("--max", args.max, pools, 1)
    sizes: dict[str, int] = {}
    bounds: dict[str, tuple[int, int]] = {}
    for pool in pools:
        start = given[pool]
        low = lows.get(pool, DEFAULT_MIN)
        high = highs.get(pool, max(DEFAULT_MAX, low, start or 0))
        if high < low:
            raise ValueError(f"--max {pool}={high} is below --min {pool}={low}")
        if start is not None and not low <= start <= high:
            raise ValueError(
                f"{SIZE_FLAGS[pool]} {start} is outside --min {pool}={low} .. --max {pool}={high}"
            )
        if start == 0:
            raise ValueError(
                f"{SIZE_FLAGS[pool]} 0: a pool starts with at least 1 worker; with"
                f" --min {pool}=0 it idles to zero after --scale-to-zero-after"
            )
        sizes[pool] = max(low, 1) if start is None else start
        bounds[pool] = (low, high)
    return sizes, bounds


def _check(flag: str, value: float | None, low: float, high: float | None = None) -> None:
    if value is None:
        return
    if value < low or (high is not None and value > high):
        allowed = f">= {low:g}" if high is None else f"between {low:g} and {high:g}"
        raise ValueError(f"{flag} must be {allowed}, got {value:g}")


def _check_knobs(args: argparse.Namespace) -> None:
    from phasefleet.api.spec import DEFAULT_INTERVAL_SECONDS

    _check("--ttft-ms", args.ttft_ms, 1)
    _check("--tpot-ms", args.tpot_ms, 1)
    _check("--percentile", args.percentile, 0.5, 0.999)
    _check("--kv-cache-target", args.kv_cache_target, 0.05, 1.0)
    _check("--scale-down-window", args.scale_down_window, 0)
    _check("--max-step", args.max_step, 1)
    _check("--peak-headroom", args.peak_headroom, 1.0, 3.0)
    if args.interval is not None and args.interval <= 0:
        raise ValueError(f"--interval must be > 0 seconds, got {args.interval:g}")
    interval = args.interval if args.interval is not None else DEFAULT_INTERVAL_SECONDS
    after = args.scale_to_zero_after
    if after is not None and after < interval:
        raise ValueError(
            f"--scale-to-zero-after must be at least --interval, {interval:g} s; got {after:g}"
        )
    window = args.signal_window
    if window is not None and window < interval:
        raise ValueError(
            f"--signal-window must be at least --interval, {interval:g} s; got {window:g}"
            " (a shorter window would skip the load between two decisions)"
        )


def scaling_config(
    args: argparse.Namespace, bounds: dict[str, tuple[int, int]], startup_s: float
) -> ScalingConfig:
    """The policy's config from flags `pool_sizes` checked; `startup_s`: a new worker's load
    time (seconds)."""
    from phasefleet.api.spec import signal_window_seconds
    from phasefleet.autoscale.policy import PoolLimits, ScalingConfig

    pools: dict[str, PoolLimits] = {
        pool: PoolLimits(low, high) for pool, (low, high) in bounds.items()
    }
    defaults = ScalingConfig(pools=pools)  # the CRD's defaults, for the flags not given
    interval_s = _given(args.interval, defaults.interval_s)
    return ScalingConfig(
        pools=pools,
        ttft_s=args.ttft_ms / 1000 if args.ttft_ms else None,
        tpot_s=args.tpot_ms / 1000 if args.tpot_ms else None,
        percentile=_given(args.percentile, defaults.percentile),
        kv_cache_target=_given(args.kv_cache_target, defaults.kv_cache_target),
        interval_s=interval_s,
        signal_window_s=signal_window_seconds(interval_s, args.signal_window),
        scale_down_stabilization_s=_given(
            args.scale_down_window, defaults.scale_down_stabilization_s
        ),
        max_step=args.max_step if args.max_step is not None else defaults.max_step,
        peak_headroom=_given(args.peak_headroom, defaults.peak_headroom),
        scale_to_zero_after_s=_given(args.scale_to_zero_after, defaults.scale_to_zero_after_s),
        startup_s=startup_s,
    )


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def hold_args(bounds: dict[str, tuple[int, int]]) -> list[str]:
    """Router flags: a fleet with a pool that may idle to zero holds requests while it wakes,
    within the InferenceService's default bounds (`--router-args` given after may change them)."""
    if not any(low == 0 for low, _ in bounds.values()):
        return []
    from phasefleet.api.contract import RouterFlag
    from phasefleet.api.spec import RouterSpec

    router = RouterSpec()
    return [
        RouterFlag.HOLD_SECONDS, str(router.hold_seconds),
        RouterFlag.MAX_HELD_REQUESTS, str(router.max_held_requests),
    ]  # fmt: skip
