"""One PNG per replayed trace: the load, each pool's replicas, and TTFT and TPOT (per minute, at
the SLO percentile) against their targets, one line per controller."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from phasefleet.plan.disagg_sim import Fleet  # noqa: E402

BIN_S = 60.0
COLORS = {
    "static peak": "0.6",
    "static mean": "0.3",
    "HPA": "tab:orange",
    "HPA 0.5": "tab:brown",
    "KEDA": "tab:purple",
    "ours": "tab:blue",
    "oracle": "tab:green",
}  # others (the oracle held through the scale-down window): olive


def per_bin(times: np.ndarray, values: np.ndarray, q: float, bins: int) -> np.ndarray:
    """The q-quantile of `values` per BIN_S of `times` (NaN where a bin is empty)."""
    slot = np.minimum((times // BIN_S).astype(int), bins - 1)
    out = np.full(bins, np.nan)
    for b in np.unique(slot):
        out[b] = np.quantile(values[slot == b], q)
    return out


def plot_runs(
    results: Mapping[str, tuple[Fleet, Any]],
    slo: Any,  # has ttft_s and tpot_s
    window_s: float,
    q: float,
    path: Path,
    title: str,
) -> None:
    fleets = {name: fleet for name, (fleet, _) in results.items()}
    tr = next(iter(fleets.values())).trace
    bins = int(max(f.end for f in fleets.values()) // BIN_S) + 1
    minutes = np.arange(bins) * BIN_S / 60
    fig, axes = plt.subplots(5, 1, figsize=(11, 13), sharex=True)
    load = np.bincount((tr.arrival // BIN_S).astype(int), minlength=bins)[:bins] / BIN_S
    tokens = np.bincount((tr.arrival // BIN_S).astype(int), tr.prompt, minlength=bins)[:bins]
    axes[0].plot(minutes, load, color="k", label="requests/s")
    twin = axes[0].twinx()
    twin.plot(minutes, tokens / BIN_S / 1000, color="tab:red", alpha=0.5, label="k prompt tok/s")
    twin.set_ylabel("k prompt tokens/s", color="tab:red")
    axes[0].set_ylabel("requests/s")
    for name, fleet in fleets.items():
        style: dict[str, Any] = {"color": COLORS.get(name, "tab:olive"), "label": name, "lw": 1.2}
        if name.startswith("static"):
            style["ls"] = "--"
        t = np.array([s.time for s in fleet.samples]) / 60
        for ax, pool in zip(axes[1:3], ("prefill", "decode"), strict=True):
            ax.step(t, [s.asked[pool] for s in fleet.samples], where="post", **style)
        long = tr.output > 1
        ttft = fleet.first_token - tr.arrival
        tpot = (fleet.finish[long] - fleet.first_token[long]) / (tr.output[long] - 1)
        axes[3].plot(minutes, per_bin(tr.arrival, ttft, q, bins), **style)
        axes[4].plot(minutes, 1000 * per_bin(tr.arrival[long], tpot, q, bins), **style)
    axes[1].set_ylabel("prefill replicas")
    axes[2].set_ylabel("decode replicas")
    pct = f"p{q * 100:g}"
    axes[3].axhline(slo.ttft_s, color="r", ls=":", label="target")
    axes[3].set_ylabel(f"TTFT {pct} per min, s")
    axes[3].set_yscale("log")
    axes[4].axhline(slo.tpot_s * 1000, color="r", ls=":", label="target")
    axes[4].set_ylabel(f"TPOT {pct} per min, ms")
    axes[4].set_yscale("log")
    axes[4].set_xlabel("minutes (requests binned by arrival)")
    axes[1].legend(ncol=3, fontsize=8, loc="upper left")
    axes[3].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
