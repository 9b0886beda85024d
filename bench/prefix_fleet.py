"""The planner's model of the prefix cache and of the router's two policies against a real local
fleet: what share of the prompt tokens the workers found in their caches, measured (the
workers' own counters) and predicted (`phasefleet.plan`'s aggregated simulator on the same
requests, with the router's own ranking code).

The Mooncake conversation trace's first requests at 1/--scale of their lengths, each 512-token
block id a run of random tokens wherever it recurs (as bench/host_kv_cache.py makes them), are
sent in the trace's own arrival batches, each batch once the one before it has finished, to a
fleet of --workers aggregated workers (`phasefleet.local`: the router and the workers as
processes, real HTTP, the bench model, a KV pool of --pool-tokens each, a host tier of a
multiple of it) under each router policy. The simulator replays the same batches, each well
after the one before.

    cd bench && ../.venv/bin/python prefix_fleet.py
    cd bench && ../.venv/bin/python prefix_fleet.py --requests 300 --tiers 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
from autoscale_curves import BENCH_KV_BYTES_PER_TOKEN, cpu_curves
from engine_throughput import model_folder
from host_kv_cache import TRACE, TRACE_BLOCK, Request, as_trace, trace_requests
from kv_bandwidth import metric_sum

from phasefleet.api.contract import Metric as M
from phasefleet.local.fleet import Fleet, FleetConfig, free_port
from phasefleet.plan.aggregated_sim import simulate_aggregated
from phasefleet.plan.prefix_cache import PrefixCaching

MODEL_NAME = "bench"
POLICIES = ("least-loaded", "prefix-aware")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--requests", type=int, default=600, help="the trace's first N requests")
    p.add_argument("--scale", type=int, default=64, help="divide the trace's lengths by this")
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pool-tokens", type=int, default=4096, help="each worker's KV pool")
    p.add_argument("--tiers", default="0,4", help="host tiers, multiples of the pool (0: none)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


COUNTERS = (M.PREFIX_CACHE_QUERIES_TOTAL, M.PREFIX_CACHE_HITS_TOTAL, M.HOST_KV_CACHE_HITS_TOTAL)


async def send_batches(url: str, requests: list[Request]) -> None:
    batches: dict[int, list[Request]] = {}
    for r in requests:
        batches.setdefault(r[0], []).append(r)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(prompt: list[int], output: int) -> None:
            body = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": output,
                "temperature": 0,
                "ignore_eos": True,
            }
            resp = await client.post(f"{url}/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"{resp.status_code}: {resp.text[:200]}")

        for batch in batches.values():
            await asyncio.gather(*(one(prompt, output) for _, prompt, output, _ in batch))


def measure(
    args: argparse.Namespace, model: Path, policy: str, tier: float, reqs: list[Request]
) -> dict[str, float]:
    """Prompt tokens queried and found (and found in host memory) over the fleet's workers."""
    worker_args = ["--num-kv-blocks", str(args.pool_tokens // 16 + 1), "--log-level", "warning"]
    if tier:  # the bench model's KV (a 16-token block) in GiB
        gib = tier * args.pool_tokens * BENCH_KV_BYTES_PER_TOKEN / 2**30
        worker_args += ["--host-kv-cache-gib", f"{gib:.6f}"]
    with tempfile.TemporaryDirectory(prefix="pf-prefix-") as tmp:
        fleet = Fleet(
            FleetConfig(
                model=str(model),
                served_model_name=MODEL_NAME,
                port=free_port(),
                pools={"worker": args.workers},
                run_dir=Path(tmp),
                worker_args=worker_args,
                router_args=["--policy", policy, "--log-level", "warning"],
                drain_timeout=5.0,
            )
        )
        fleet.start()
        try:
            asyncio.run(send_batches(fleet.url, reqs))
            texts = [
                httpx.get(f"{w.url}/metrics", timeout=10).text for w in fleet.members()["worker"]
            ]
            totals = {name: sum(metric_sum(t, name) for t in texts) for name in COUNTERS}
        finally:
            fleet.stop()
    return totals


def predict(
    args: argparse.Namespace, policy: str, tier: float, reqs: list[Request]
) -> tuple[float, float]:
    """(found share, host share) of the prompt tokens in the simulator."""
    arrivals = {a: k for k, a in enumerate(dict.fromkeys(r[0] for r in reqs))}
    batches = np.array([1000.0 * arrivals[r[0]] for r in reqs])  # each long after the last
    trace = as_trace(reqs, TRACE_BLOCK // args.scale, batches)
    curves = replace(cpu_curves(), kv_capacity_tokens=args.pool_tokens, chunk_tokens=2048)
    caching = PrefixCaching(
        host_tokens=int(tier * args.pool_tokens), prefix_aware=policy == "prefix-aware"
    )
    fleet = simulate_aggregated(trace, curves, args.workers, caching)
    assert fleet.prefix is not None
    return fleet.prefix.stats.found_share, fleet.prefix.stats.host_share


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    model = model_folder(None)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    reqs = trace_requests(args, vocab)
    tiers = [float(t) for t in args.tiers.split(",")]
    print(
        f"machine: {platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {args.trace.name}: the first {len(reqs)} "
        f"requests at 1/{args.scale} ({sum(len(r[1]) for r in reqs)} prompt tokens); "
        f"{args.workers} workers of a {args.pool_tokens}-token pool\n\n"
        "| router | host tier | found, measured | found, predicted | from host, measured | "
        "from host, predicted |\n|---|---|---|---|---|---|"
    )
    for tier in tiers:
        for policy in POLICIES:
            got = measure(args, model, policy, tier, reqs)
            queried = got[M.PREFIX_CACHE_QUERIES_TOTAL]
            found = got[M.PREFIX_CACHE_HITS_TOTAL] / queried
            host = got[M.HOST_KV_CACHE_HITS_TOTAL] / queried
            want, want_host = predict(args, policy, tier, reqs)
            print(
                f"| {policy} | {f'{tier:g}x the pool' if tier else 'none'} | {found:.1%} | "
                f"{want:.1%} | {host:.1%} | {want_host:.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
