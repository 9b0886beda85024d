"""Late prompts last on a real worker: the same burst, first come, first served and with
`--late-after-ms`, side by side (one `phasefleet serve`-style local fleet per order: a router
and one aggregated worker, real HTTP, every request streamed and timed by the client).

The worker's capacity is measured first (32 prompts of --prompt tokens, --max-tokens each, at
once); the burst then sends --overload times that rate for --burst-s seconds.
First come, first served, every prompt behind the burst's first backlog of one TTFT target
misses it; with late prompts last the worker serves the fresh ones first.

    .venv/bin/phasefleet make-tiny /tmp/pf-bench --preset bench
    .venv/bin/python bench/late_fleet.py --model /tmp/pf-bench
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
from pathlib import Path
from statistics import median

import httpx
from stream_client import RequestTiming, stream_completion

from phasefleet.local.fleet import Fleet, FleetConfig, free_port

MODEL_NAME = "bench"


def prompt(n: int, salt: int, vocab: int = 4000) -> list[int]:
    """n tokens no other prompt shares a prefix with (no prefix-cache hits)."""
    return [10 + (salt * 7919 + i * 104729) % (vocab - 10) for i in range(n)]


async def capacity(
    client: httpx.AsyncClient, url: str, args: argparse.Namespace, salt: int
) -> float:
    """Requests a second the worker finishes when 32 come at once (a burst batches); `salt`
    keeps each call's prompts apart (a repeated prompt would be a prefix-cache hit)."""
    started = time.perf_counter()
    timings = await asyncio.gather(
        *(
            stream_completion(
                client, url, MODEL_NAME, prompt(args.prompt, salt + i), args.max_tokens, started
            )
            for i in range(32)
        )
    )
    failed = [t.error for t in timings if not t.ok]
    if failed:
        raise RuntimeError(f"a capacity request failed: {failed[0]}")
    return 32 / (time.perf_counter() - started)


async def burst(
    client: httpx.AsyncClient, url: str, rate: float, args: argparse.Namespace
) -> list[RequestTiming]:
    n = int(rate * args.burst_s)
    zero = time.perf_counter()

    async def one(i: int) -> RequestTiming:
        await asyncio.sleep(max(0.0, i / rate - (time.perf_counter() - zero)))
        return await stream_completion(
            client, url, MODEL_NAME, prompt(args.prompt, i), args.max_tokens, zero
        )

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def late_total(metrics: str) -> float:
    found = re.findall(r"^phasefleet_late_prompts_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M)
    return sum(float(v) for v in found)


def run_order(args: argparse.Namespace, late: bool, rate: float | None, run_dir: Path) -> dict:
    fleet = Fleet(
        FleetConfig(
            model=str(args.model),
            served_model_name=MODEL_NAME,
            port=free_port(),
            pools={"worker": 1},
            run_dir=run_dir / ("late" if late else "fcfs"),
            late_after_ms=args.ttft_ms if late else None,  # the router sends it per request
            router_args=["--log-level", "warning"],
            drain_timeout=5.0,
        )
    )
    fleet.start()
    try:

        async def drive() -> dict:
            limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                await capacity(client, fleet.url, args, 100_000)  # warm-up: oneDNN's shapes
                measured = await capacity(client, fleet.url, args, 200_000)
                use = rate or measured * args.overload
                timings = await burst(client, fleet.url, use, args)
                metrics = (await client.get(f"{fleet.workers['worker'][0].url}/metrics")).text
            late_prompts = late_total(metrics)
            return {"capacity": measured, "rate": use, "timings": timings, "late": late_prompts}

        return asyncio.run(drive())
    finally:
        fleet.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="make-tiny DIR --preset bench")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--ttft-ms", type=int, default=1000, help="the TTFT target")
    p.add_argument("--overload", type=float, default=1.5, help="the burst's rate / capacity")
    p.add_argument("--burst-s", type=float, default=20.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pf-late-") as tmp:
        fcfs = run_order(args, False, None, Path(tmp))
        late = run_order(args, True, fcfs["rate"], Path(tmp))  # the same arrivals
    target = args.ttft_ms / 1000
    print(
        f"prompt {args.prompt} tokens, {args.max_tokens} out; capacity {fcfs['capacity']:.2f} "
        f"req/s (late run: {late['capacity']:.2f}); burst {fcfs['rate']:.2f} req/s for "
        f"{args.burst_s:g} s; TTFT target {args.ttft_ms} ms"
    )
    print("| order | requests | answered | TTFT met | TTFT p50 | TTFT max | late prompts |")
    print("|---|---|---|---|---|---|---|")
    met = {}
    for name, r in (("first come, first served", fcfs), ("late prompts last", late)):
        ok = [t for t in r["timings"] if t.ok]
        ttft = sorted(t.ttft for t in ok)
        met[name] = sum(1 for x in ttft if x <= target)
        print(
            f"| {name} | {len(r['timings'])} | {len(ok)} | {met[name]} "
            f"({met[name] / len(r['timings']):.0%}) | {median(ttft):.2f} s | {ttft[-1]:.2f} s "
            f"| {r['late']:.0f} |"
        )
    errors = [t.error for r in (fcfs, late) for t in r["timings"] if not t.ok]
    if errors:
        print(f"{len(errors)} requests failed, e.g. {errors[0]}")
    first = met["first come, first served"]
    print(f"met, late last / first come: {met['late prompts last'] / max(first, 1):.2f}x")


if __name__ == "__main__":
    main()
