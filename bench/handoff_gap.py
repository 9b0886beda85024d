"""The hand-off's cost where a user sees it: the gap between token 1 and token 2 of a prompt that
was prefilled on a prefill worker, against the median gap between later tokens, by prompt
length; TTFT and TPOT beside it. Two fleets of 1 prefill + 1 decode worker serve the same model
one after the other in one run, every prompt handed off (`--remote-prefill-min-tokens 0`): the
code of this checkout (the streamed hand-off) and, with `--old REPO`, another checkout's (e.g. a
worktree of the commit before it, whose decode worker pulled the whole prompt's KV after token
1). One thread per worker (OMP_NUM_THREADS=1), prompts in random order, each length `--repeats`
times; a PNG of gap minus ITL against prompt length next to the numbers.

    git worktree add /tmp/old <commit>
    .venv/bin/python bench/handoff_gap.py --model smollm2 --old /tmp/old
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from stream_client import RequestTiming, stream_completion

from phasefleet.local.fleet import Fleet, FleetConfig, free_port
from phasefleet.server.model_source import resolve_model

LENGTHS = (256, 512, 1024, 2048, 4096, 6144)
OUTPUT = 12  # tokens per answer: token 1, the gap, then ten more for the inter-token gap


def run_fleet(model: str, code: Path | None, lengths: list[int], repeats: int) -> list[dict]:
    """Every length `repeats` times through one fleet running `code` (None: this checkout)."""
    env_before = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    if code is not None:
        os.environ["PYTHONPATH"] = f"{code / 'runtime_image'}:{code / 'operator'}"
    run_dir = Path(tempfile.mkdtemp(prefix="handoff-gap-"))
    fleet = Fleet(
        FleetConfig(
            model=model,
            served_model_name="m",
            port=free_port(),
            pools={"prefill": 1, "decode": 1},
            run_dir=run_dir,
            worker_args=["--remote-prefill-min-tokens", "0", "--max-model-len", "8192"],
        )
    )
    try:
        fleet.start()
        order = [n for n in lengths for _ in range(repeats)]
        random.Random(0).shuffle(order)
        return asyncio.run(_measure(fleet.url, order))
    finally:
        fleet.stop()
        os.environ.clear()
        os.environ.update(env_before)


async def _measure(url: str, order: list[int]) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_completion(client, url, "m", [10] * 64, 4, time.perf_counter())  # warm-up
        for i, n in enumerate(order):
            prompt = [10 + (i * 7919 + j * 104729) % 40000 for j in range(n)]  # no cache hits
            t: RequestTiming = await stream_completion(
                client, url, "m", prompt, OUTPUT, time.perf_counter()
            )
            if not t.ok or len(t.token_times) < OUTPUT:
                raise RuntimeError(f"{n}-token prompt failed: {t.error}")
            gaps = [g for _, g in t.gaps()]
            rows.append(
                {
                    "tokens": n,
                    "ttft": t.ttft,
                    "gap12": gaps[0],
                    "itl": statistics.median(gaps[1:]),
                    "tpot": t.tpot,
                }
            )
    return rows


def summary(rows: list[dict], n: int) -> dict[str, float]:
    mine = [r for r in rows if r["tokens"] == n]
    extra = [r["gap12"] - r["itl"] for r in mine]
    return {
        "extra_p50": statistics.median(extra),
        "extra_max": max(extra),
        "ttft_p50": statistics.median(r["ttft"] for r in mine),
        "tpot_p50": statistics.median(r["tpot"] for r in mine),
        "tpot_max": max(r["tpot"] for r in mine),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--old", type=Path, help="another checkout to run side by side")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plot", type=Path, default=Path(__file__).with_name("handoff_gap.png"))
    args = p.parse_args()
    model = resolve_model(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    runs = {"streamed (this checkout)": run_fleet(model, None, lengths, args.repeats)}
    if args.old is not None:
        runs[f"old ({args.old})"] = run_fleet(model, args.old, lengths, args.repeats)
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, model {args.model}, {sys.version.split()[0]}")
    print(
        "prompt | "
        + " | ".join(
            f"{name}: gap1-2 minus ITL p50 / max, TTFT p50, TPOT p50 / max (ms)" for name in runs
        )
    )
    for n in lengths:
        cells = []
        for rows in runs.values():
            ms = {key: value * 1e3 for key, value in summary(rows, n).items()}
            cells.append(
                f"{ms['extra_p50']:.0f} / {ms['extra_max']:.0f}, {ms['ttft_p50']:.0f}, "
                f"{ms['tpot_p50']:.0f} / {ms['tpot_max']:.0f}"
            )
        print(f"{n} | " + " | ".join(cells))
    plot(runs, lengths, args.plot)
    print(f"plot: {args.plot}")


def plot(runs: dict[str, list[dict]], lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs.items():
        ax.plot(lengths, [summary(rows, n)["extra_p50"] * 1e3 for n in lengths], "o-", label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("token 1 -> 2 gap minus median ITL, p50 (ms)")
    ax.set_title("What the KV hand-off adds between token 1 and token 2")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
