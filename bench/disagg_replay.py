"""Trace replay against three local fleets with the same workers and CPU threads: aggregated
without chunked prefill, aggregated with chunked prefill, and disaggregated (prefill + decode).

A segment of the Azure 2023 conversation trace is replayed with its arrival times; prompt and
output lengths are divided by --scale to fit the bench model on a CPU. Every request streams
through the fleet's router; the client times every token. Printed side by side: TTFT, ITL and
TPOT p50/p99 and goodput; then router overhead (the same requests straight to a worker and
through the router) and hand-off bandwidth (KV pulls against one loopback TCP socket).

    .venv/bin/python bench/disagg_replay.py --model /tmp/pf-bench --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from statistics import median

import httpx
from itl_plot import plot_itl
from kv_bandwidth import HandoffTotals, Pull, handoff_totals, socket_seconds, stream_kv
from latency_stats import Summary, Targets, summarize
from router_overhead import Overhead, measure_overhead
from stream_client import RequestTiming, stream_completion
from trace_segment import AZURE_CONV, TraceRequest, load_segment

from phasefleet.api.boundary import DEFAULT_IDLE_MIN_TOKENS, DEFAULT_LOCAL_MAX_TOKENS
from phasefleet.local.fleet import Fleet, FleetConfig, free_port

MODEL_NAME = "bench"
WARMUP_PROMPTS = (8, 48, 128, 256, 512)  # tokens; each sent twice, so both workers see it
WARMUP_BATCH = 48  # concurrent warm-up requests


@dataclass
class SideResults:
    """What a setup measured besides the replay."""

    load_before: float = 0.0  # 1-minute load average when the replay started
    load_after: float = 0.0
    overhead: Overhead | None = None  # the 1-worker fleet
    handoffs: HandoffTotals | None = None  # disaggregated: the replay's pulls
    worker_pulls: HandoffTotals | None = None  # --pull-tokens prompts through the router
    # (httpx pull, bare-socket pull, socket seconds for the same bytes)
    pulls: list[tuple[Pull, float]] = field(default_factory=list)  # (stream, socket seconds)


@dataclass(frozen=True)
class Setup:
    name: str
    pools: dict[str, int]
    worker_args: list[str]
    measure_overhead: bool = False  # router vs straight to a worker, after the replay


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="e.g. make-tiny DIR --preset bench")
    p.add_argument("--trace", type=Path, default=AZURE_CONV)
    p.add_argument("--start", type=float, default=0.0, help="segment start, s into the trace")
    p.add_argument("--duration", type=float, default=30.0, help="segment length, seconds")
    p.add_argument("--scale", type=float, default=8.0, help="divide trace lengths by this")
    p.add_argument("--max-prompt", type=int, default=1024, help="prompt cap after scaling")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    p.add_argument("--chunk", type=int, default=128, help="token budget with chunked prefill")
    p.add_argument("--remote-min", type=int, default=32, help="--remote-prefill-min-tokens")
    p.add_argument("--speed", type=float, default=1.0, help="arrivals this many times faster")
    p.add_argument(
        "--boundary",
        choices=("fixed", "adaptive", "both"),
        default="fixed",
        help="disaggregated: the phase boundary (both: one fleet of each); its token knobs are\n"
        "divided by --scale as the lengths are",
    )
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks per worker")
    p.add_argument("--ttft-target", type=float, default=2.0, help="seconds, for goodput")
    p.add_argument("--tpot-target", type=float, default=0.15, help="seconds, for goodput")
    p.add_argument(
        "--setups",
        type=lambda v: v.split(","),
        default=[],
        help="only these: aggregated, disaggregated, router (first words of the names)",
    )
    p.add_argument("--rounds", type=int, default=1, help="replays of every setup, pooled")
    p.add_argument("--overhead-pairs", type=int, default=30)
    p.add_argument("--pull-tokens", type=int, default=2048, help="prompt of the timed pulls")
    p.add_argument("--pulls", type=int, default=3)
    p.add_argument("--plot", type=Path, default=Path(__file__).with_name("disagg_itl.png"))
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    return p.parse_args()


def setups(args: argparse.Namespace, longest: int) -> list[Setup]:
    whole = max(2048, longest + 64)  # one step holds the longest prompt plus a batch of decodes
    common = ["--num-kv-blocks", str(args.num_kv_blocks), "--log-level", "warning"]
    return [
        Setup(
            "aggregated, no chunking",
            {"worker": 2},
            [*common, "--max-num-batched-tokens", str(whole)],
        ),
        Setup(
            f"aggregated, chunked ({args.chunk})",
            {"worker": 2},
            [*common, "--max-num-batched-tokens", str(args.chunk)],
        ),
    ] + [
        Setup(
            "disaggregated 1P+1D" + ("" if boundary == "fixed" else ", adaptive boundary"),
            {"prefill": 1, "decode": 1},
            [
                *common,
                "--max-num-batched-tokens",
                str(whole),
                "--remote-prefill-min-tokens",
                str(args.remote_min),
                *boundary_args(args, boundary),
            ],
        )
        for boundary in (("fixed", "adaptive") if args.boundary == "both" else (args.boundary,))
    ]


def boundary_args(args: argparse.Namespace, boundary: str) -> list[str]:
    if boundary == "fixed":
        return []
    return [
        "--adaptive-phase-boundary",
        "--tpot-target-ms", f"{args.tpot_target * 1000:g}",
        "--boundary-idle-min-tokens", str(round(DEFAULT_IDLE_MIN_TOKENS / args.scale)),
        "--boundary-local-max-tokens", str(round(DEFAULT_LOCAL_MAX_TOKENS / args.scale)),
    ]  # fmt: skip


async def replay(
    client: httpx.AsyncClient, url: str, segment: list[TraceRequest]
) -> list[RequestTiming]:
    zero = time.perf_counter()

    async def one(r: TraceRequest) -> RequestTiming:
        await asyncio.sleep(max(0.0, r.offset - (time.perf_counter() - zero)))
        return await stream_completion(
            client, url, MODEL_NAME, r.prompt_token_ids, r.max_tokens, zero
        )

    return list(await asyncio.gather(*(one(r) for r in segment)))


async def warm_up(client: httpx.AsyncClient, url: str, vocab: int) -> None:
    """oneDNN builds a primitive per row count the first time it sees it: pay that here, for
    prefills of several lengths and for decode batches of every size up to WARMUP_BATCH."""

    def prompt(n: int, salt: int) -> list[int]:
        return [10 + (i * 7919 + n * 31 + salt) % (vocab - 10) for i in range(n)]

    for n in WARMUP_PROMPTS:
        for salt in range(2):
            t = await stream_completion(
                client, url, MODEL_NAME, prompt(n, salt), 8, time.perf_counter()
            )
            if not t.ok:
                raise RuntimeError(f"warm-up request failed: {t.error}")
    zero = time.perf_counter()
    batch = await asyncio.gather(
        *(
            stream_completion(client, url, MODEL_NAME, prompt(8 + 7 * i % 60, i), 2 + i, zero)
            for i in range(WARMUP_BATCH)
        )
    )  # they end one step apart: every batch size from WARMUP_BATCH down to 1
    if not all(t.ok for t in batch):
        raise RuntimeError(f"warm-up request failed: {[t.error for t in batch if not t.ok]}")


def run_setup(
    args: argparse.Namespace, setup: Setup, segment: list[TraceRequest], vocab: int, run_dir: Path
) -> tuple[list[RequestTiming], SideResults]:
    fleet = Fleet(
        FleetConfig(
            model=str(args.model),
            served_model_name=MODEL_NAME,
            port=free_port(),
            pools=setup.pools,
            run_dir=run_dir / "".join(c if c.isalnum() else "-" for c in setup.name),
            worker_args=setup.worker_args,
            router_args=["--log-level", "warning"],
            drain_timeout=5.0,
        )
    )
    extra = SideResults()
    print(f"[{setup.name}] starting {setup.pools}", flush=True)
    fleet.start()
    try:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)

        async def drive() -> list[RequestTiming]:
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                await warm_up(client, fleet.url, vocab)
                time.sleep(2.0)  # the router's load poll sees idle workers again
                decode = fleet.workers["decode"][0].url if "decode" in setup.pools else None
                before = None if decode is None else await handoff_totals(client, decode)
                extra.load_before = os.getloadavg()[0]
                timings = await replay(client, fleet.url, segment) if segment else []
                extra.load_after = os.getloadavg()[0]
                if decode is not None and before is not None:
                    extra.handoffs = (await handoff_totals(client, decode)) - before
                if setup.measure_overhead:
                    extra.overhead = await measure_overhead(
                        client,
                        fleet.url,
                        fleet.workers["worker"][0].url,
                        MODEL_NAME,
                        args.overhead_pairs,
                        64,
                        16,
                        vocab,
                    )
                return timings

        timings = asyncio.run(drive())
        if "prefill" in setup.pools:
            prompt = [10 + (i * 104729) % (vocab - 10) for i in range(args.pull_tokens)]
            prefill = fleet.workers["prefill"][0].url
            for i in range(args.pulls):
                prompt[0] = 10 + 2 * i  # no prefix-cache hit on the prefill worker
                pull = stream_kv(prefill, fleet.token, prompt)
                sock = min(socket_seconds(pull.tail_bytes) for _ in range(3))
                extra.pulls.append((pull, sock))

            async def worker_pulls() -> HandoffTotals:
                """Long prompts through the router: the decode worker's own pulls."""
                decode = fleet.workers["decode"][0].url
                async with httpx.AsyncClient(timeout=600) as client:
                    before = await handoff_totals(client, decode)
                    for i in range(args.pulls):
                        prompt[0] = 1000 + i
                        t = await stream_completion(
                            client, fleet.url, MODEL_NAME, prompt, 2, time.perf_counter()
                        )
                        if not t.ok:
                            raise RuntimeError(f"long-prompt request failed: {t.error}")
                    return (await handoff_totals(client, decode)) - before

            extra.worker_pulls = asyncio.run(worker_pulls())
    finally:
        fleet.stop()
    return timings, extra


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def print_table(summaries: dict[str, Summary], loads: dict[str, tuple[float, float]]) -> None:
    rows: list[tuple[str, ...]] = [
        ("setup", *summaries),
        ("requests (failed)", *(f"{s.requests} ({s.failed})" for s in summaries.values())),
        (
            "TTFT p50 / p99 ms",
            *(f"{ms(s.ttft_p50)} / {ms(s.ttft_p99)}" for s in summaries.values()),
        ),
        ("ITL p50 / p99 ms", *(f"{ms(s.itl_p50)} / {ms(s.itl_p99)}" for s in summaries.values())),
        ("ITL max ms", *(ms(s.itl_max) for s in summaries.values())),
        (
            "TPOT p50 / p99 ms",
            *(f"{ms(s.tpot_p50)} / {ms(s.tpot_p99)}" for s in summaries.values()),
        ),
        ("met both targets", *(f"{s.met}/{s.requests}" for s in summaries.values())),
        ("goodput req/s", *(f"{s.goodput:.2f}" for s in summaries.values())),
        ("output tok/s", *(f"{s.throughput:.1f}" for s in summaries.values())),
        ("load avg before / after", *(f"{a:.1f} / {b:.1f}" for a, b in loads.values())),
    ]
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows[1:]:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # every worker inherits it
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    segment = load_segment(
        args.trace, args.start, args.duration, args.scale, args.max_prompt, vocab
    )
    segment = [replace(r, offset=r.offset / args.speed) for r in segment]
    lengths = sorted(len(r.prompt_token_ids) for r in segment)
    print(
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}; segment {args.start:.0f}+{args.duration:.0f} s of "
        f"{'' if args.speed == 1 else f'(played {args.speed:g}x as fast) '}"
        f"{args.trace.name}: {len(segment)} requests, prompt tokens p50 "
        f"{lengths[len(lengths) // 2]} max {lengths[-1]} (sum {sum(lengths)}), output tokens "
        f"sum {sum(r.max_tokens for r in segment)}; {args.threads} thread(s) per worker",
        flush=True,
    )
    targets = Targets(args.ttft_target, args.tpot_target)
    runs: dict[str, list[RequestTiming]] = {}
    loads: dict[str, tuple[float, float]] = {}
    extras: dict[str, SideResults] = {}
    with tempfile.TemporaryDirectory(prefix="pf-replay-") as tmp:
        pooled: dict[str, list[list[RequestTiming]]] = {}
        for round_ in range(args.rounds):  # setups alternate, so outside load hits each alike
            for setup in setups(args, lengths[-1]):
                if args.setups and setup.name.split()[0].strip(",") not in args.setups:
                    continue
                timings, extra = run_setup(args, setup, segment, vocab, Path(tmp))
                if round_ == 0:
                    runs[setup.name], extras[setup.name] = timings, extra
                pooled.setdefault(setup.name, []).append(timings)
                load = loads.get(setup.name, (extra.load_before, extra.load_after))
                loads[setup.name] = (
                    max(load[0], extra.load_before),
                    max(load[1], extra.load_after),
                )
                print(f"[{setup.name}] round {round_ + 1}: {summarize([timings], targets)}")
        summaries = {name: summarize(t, targets) for name, t in pooled.items()}
        # one worker behind the router, so both paths reach the same engine
        alone = Setup(
            "router overhead, 1 worker",
            {"worker": 1},
            ["--num-kv-blocks", str(args.num_kv_blocks), "--log-level", "warning"],
            measure_overhead=True,
        )
        if not args.setups or "router" in args.setups:
            _, extras[alone.name] = run_setup(args, alone, [], vocab, Path(tmp))

    print(f"\ngoodput targets: TTFT <= {args.ttft_target} s and TPOT <= {args.tpot_target} s\n")
    print_table(summaries, loads)

    print("\nrouter overhead (p50, one request at a time, interleaved):")
    for name, extra in extras.items():
        o = extra.overhead
        if o is not None:
            print(
                f"  {name}, {o.pairs} pairs: TTFT direct {o.direct_ttft_p50 * 1000:.1f} ms, "
                f"router {o.router_ttft_p50 * 1000:.1f} ms, "
                f"+{(o.router_ttft_p50 - o.direct_ttft_p50) * 1000:.1f} ms; ITL direct "
                f"{o.direct_itl_p50 * 1000:.2f} ms, router {o.router_itl_p50 * 1000:.2f} ms, "
                f"+{(o.router_itl_p50 - o.direct_itl_p50) * 1000:.2f} ms"
            )
    print("\nhand-off bandwidth:")
    for extra in extras.values():
        if extra.pulls:
            ratios = sorted(p.gbps / (p.tail_bytes / sock / 1e9) for p, sock in extra.pulls)
            print(
                f"  median of {len(ratios)}: KV stream after the first token "
                f"{median(p.gbps for p, _ in extra.pulls):.2f} GB/s, socket "
                f"{median(p.tail_bytes / sock / 1e9 for p, sock in extra.pulls):.2f} GB/s, "
                f"stream / socket {median(ratios):.2f}"
            )
    for extra in extras.values():
        h = extra.handoffs
        if h is not None and h.pulls:
            print(
                f"  replay: prompts prefilled remote {h.remote}, local {h.local}, hand-off "
                f"failures {h.failures}; {h.pulls} pulls by the decode worker, "
                f"{h.nbytes / h.pulls / 1e6:.2f} MB each on average, streams of "
                f"{h.seconds / h.pulls * 1000:.0f} ms on average (request to end, prefill included)"
            )
        w = extra.worker_pulls
        if w is not None and w.pulls:
            print(
                f"  decode worker's own pulls of {args.pull_tokens}-token prompts (its metrics): "
                f"{w.pulls} pulls, {w.nbytes / w.pulls / 1e6:.1f} MB each, streams of "
                f"{w.seconds / w.pulls * 1000:.0f} ms (prefill included); failures {w.failures}"
            )
        for pull, sock in extra.pulls:
            socket_gbps = pull.tail_bytes / sock / 1e9
            print(
                f"  {args.pull_tokens} tokens, {pull.nbytes / 1e6:.1f} MB: after the first token "
                f"{pull.tail_bytes / 1e6:.1f} MB at {pull.gbps:.2f} GB/s "
                f"({pull.tail_seconds * 1000:.0f} ms; the stream with its prefill "
                f"{pull.seconds * 1000:.0f} ms); one loopback TCP socket {socket_gbps:.2f} GB/s "
                f"({sock * 1000:.0f} ms); stream / socket {pull.gbps / socket_gbps:.2f}"
            )
    if runs:
        plot_itl(
            runs,
            long_prompt=args.chunk * 2,
            path=args.plot,
            title=f"per-token ITL (round 1), {args.trace.name} "
            f"{args.start:.0f}+{args.duration:.0f} s, lengths / {args.scale:g}, "
            f"2 workers x {args.threads} thread",
        )
        print(f"\nplot: {args.plot}")
    if args.json is not None:
        numbers = {
            name: {
                "summary": asdict(summaries[name]),
                "side": asdict(extras[name]),
                "round_1": [asdict(t) for t in runs[name]],
            }
            for name in summaries
        }
        args.json.write_text(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    main()
