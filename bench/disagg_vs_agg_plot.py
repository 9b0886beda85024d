"""One PNG per curves for bench/disagg_vs_agg.py, in the manner of DistServe's figures: SLO
attainment vs request rate per GPU, a column per trace, a row per SLO, a line per setup
(aggregated solid blues, disaggregated dashed reds), the target as a black line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402


def plot_attainment(
    sweeps: Mapping[str, Any],  # trace -> Sweep (rates [R], attained: setup -> [SLOs, R])
    panels: Mapping[str, Sequence[str]],  # trace -> a title per SLO
    target: float,
    path: Path,
    title: str,
) -> None:
    traces = list(sweeps)
    rows = len(panels[traces[0]])
    fig, axes = plt.subplots(rows, len(traces), figsize=(3.6 * len(traces), 8), squeeze=False)
    for col, trace in enumerate(traces):
        sw = sweeps[trace]
        agg = [s for s in sw.attained if s.aggregated]
        dis = [s for s in sw.attained if not s.aggregated]
        colors = {s: plt.cm.Blues(0.45 + 0.55 * k / len(agg)) for k, s in enumerate(agg)}
        colors |= {s: plt.cm.autumn(k / len(dis)) for k, s in enumerate(dis)}
        for row in range(rows):
            ax = axes[row][col]
            for s, a in sw.attained.items():
                style = "-" if s.aggregated else "--"
                pct = np.asarray(a[row]) * 100
                ax.plot(sw.rates, pct, style, color=colors[s], marker=".", ms=3, lw=1, label=s.name)
            ax.axhline(target * 100, color="k", lw=0.6)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(0, 102)
            ax.set_title(panels[trace][row], fontsize=8)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_ylabel("SLO attainment %")
            if row == rows - 1:
                ax.set_xlabel("requests/s per GPU")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
