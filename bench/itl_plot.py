"""The per-token ITL over time plot, one panel per setup."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from stream_client import RequestTiming  # noqa: E402

TICKS_MS = [10, 20, 50, 100, 200, 500, 1000, 2000, 5000]


def plot_itl(
    runs: dict[str, list[RequestTiming]],
    long_prompt: int,  # tokens: arrivals at least this long are marked
    path: Path,
    title: str,
) -> None:
    fig, grid = plt.subplots(
        len(runs), 1, figsize=(11, 2.6 * len(runs)), sharex=True, sharey=True, squeeze=False
    )
    axes = list(grid[:, 0])
    for ax, (name, timings) in zip(axes, runs.items(), strict=True):
        points = [g for t in timings if t.ok for g in t.gaps()]
        ax.scatter([w for w, _ in points], [gap * 1000 for _, gap in points], s=5, alpha=0.5, lw=0)
        for t in timings:
            if t.prompt_tokens >= long_prompt:
                ax.axvline(t.sent, color="tab:red", lw=0.6, alpha=0.4)
        ax.set_yscale("log")
        ax.set_yticks(TICKS_MS, [str(t) for t in TICKS_MS])
        ax.minorticks_off()
        ax.set_ylabel("ITL (ms)")
        ax.set_title(name, fontsize=10, loc="left")
        ax.grid(True, which="major", alpha=0.3)
    axes[-1].set_xlabel(f"replay time (s); red lines: arrivals of prompts >= {long_prompt} tokens")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
