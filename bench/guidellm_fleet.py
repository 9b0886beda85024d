"""A peer load generator's view of our endpoints: guidellm (e2e/tools/install-guidellm.sh) runs
the same concurrent loads against a local aggregated fleet (2 workers) and a disaggregated one
(1 prefill + 1 decode worker), each the fleet `phasefleet serve` runs, on the same model, one
CPU thread per worker (OMP_NUM_THREADS=1: two workers on a 2-core machine, as in
disagg_replay.py), and prints guidellm's own TTFT, ITL and throughput side by side with the
disaggregated / aggregated ratio, plus a PNG.

    .venv/bin/python bench/guidellm_fleet.py --model /tmp/pf-bench --streams 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from phasefleet.local.fleet import Fleet, FleetConfig, free_port

ROOT = Path(__file__).resolve().parent.parent
FLEETS = {"aggregated": {"worker": 2}, "disaggregated": {"prefill": 1, "decode": 1}}


def guidellm() -> str:
    install = ROOT / "e2e" / "tools" / "install-guidellm.sh"
    done = subprocess.run(["bash", str(install)], check=True, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


def start_fleet(model: Path, mode: str) -> Fleet:
    """The fleet `phasefleet serve` runs (router and worker processes), started and healthy."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"pf-guidellm-{mode}-"))
    config = FleetConfig(
        model=str(model),
        served_model_name="bench",
        port=free_port(),
        pools=dict(FLEETS[mode]),
        run_dir=run_dir,
        router_args=["--log-level", "warning"],
    )
    fleet = Fleet(config)
    fleet.start()
    return fleet


def run_load(binary: str, url: str, model: Path, streams: int, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    command = [
        binary, "run",
        "--backend", f"kind=openai_http,target={url},model=bench",
        "--profile", f"kind=concurrent,streams={streams}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt},output_tokens={args.output}",
        "--tokenizer", f"kind=huggingface_auto,model={model}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"guidellm failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return summarize(report["benchmarks"][0])


def summarize(benchmark: dict[str, Any]) -> dict[str, float]:
    m = benchmark["metrics"]

    def pct(name: str, p: str) -> float:
        return float(m[name]["successful"]["percentiles"][p])

    return {
        "ok": float(m["request_totals"]["successful"]),
        "errors": float(m["request_totals"]["errored"] + m["request_totals"]["incomplete"]),
        "ttft_p50": pct("time_to_first_token_ms", "p50"),
        "ttft_p99": pct("time_to_first_token_ms", "p99"),
        "itl_p50": pct("inter_token_latency_ms", "p50"),
        "itl_p99": pct("inter_token_latency_ms", "p99"),
        "out_tok_s": float(m["output_tokens_per_second"]["successful"]["mean"]),
    }


def plot(results: dict[str, dict[int, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, by_streams in results.items():
        streams = sorted(by_streams)
        for ax, key, label in zip(
            axes,
            ("ttft_p99", "itl_p99", "out_tok_s"),
            ("TTFT p99 (ms)", "ITL p99 (ms)", "output tokens/s"),
            strict=True,
        ):
            ax.plot(streams, [by_streams[s][key] for s in streams], marker="o", label=mode)
            ax.set_xlabel("concurrent streams (guidellm)")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
    axes[0].legend()
    fig.suptitle(
        "guidellm against phasefleet serve: aggregated (2 workers) vs 1 prefill + 1 decode"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="model folder (make-tiny --preset)")
    p.add_argument("--streams", default="1,2,4,8", help="concurrency levels")
    p.add_argument("--requests", type=int, default=40, help="requests per level")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (synthetic)")
    p.add_argument("--output", type=int, default=64, help="output tokens per request")
    p.add_argument("--png", type=Path, default=ROOT / "bench" / "guidellm_fleet.png")
    args = p.parse_args()
    binary = guidellm()
    levels = [int(s) for s in args.streams.split(",")]
    results: dict[str, dict[int, dict[str, float]]] = {}
    os.environ["OMP_NUM_THREADS"] = "1"  # one core per worker (they inherit it): a fair match
    for mode in FLEETS:
        fleet = start_fleet(args.model, mode)
        try:
            warm = argparse.Namespace(**{**vars(args), "requests": 4})  # first requests' setup
            run_load(binary, fleet.url, args.model, 1, warm)
            results[mode] = {s: run_load(binary, fleet.url, args.model, s, args) for s in levels}
        finally:
            fleet.stop()
    args.png.with_suffix(".json").write_text(json.dumps(results, indent=1))

    def ratio(num: float, den: float) -> str:
        return f"{num / den:.2f}" if den else "-"

    print("| streams | fleet | ok / errors | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    for s in levels:
        for mode in FLEETS:
            r = results[mode][s]
            print(
                f"| {s} | {mode} | {r['ok']:.0f} / {r['errors']:.0f} | {r['ttft_p50']:.0f} /"
                f" {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} / {r['itl_p99']:.1f} |"
                f" {r['out_tok_s']:.1f} |"
            )
        a, d = results["aggregated"][s], results["disaggregated"][s]
        print(
            f"| {s} | disagg / agg | | {ratio(d['ttft_p50'], a['ttft_p50'])} /"
            f" {ratio(d['ttft_p99'], a['ttft_p99'])} | {ratio(d['itl_p50'], a['itl_p50'])} /"
            f" {ratio(d['itl_p99'], a['itl_p99'])} | {ratio(d['out_tok_s'], a['out_tok_s'])} |"
        )
    plot(results, args.png)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
