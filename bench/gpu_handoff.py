"""The KV hand-off on the device: device -> host -> socket -> device, between two workers.

Three views of the same bytes (a 2048-token prompt's KV in Llama 3 8B's layout, 256 MiB):
- in this process, the model runner's own copies: `read_kv` (device to host, wire order) and
  `write_kv` (host to device), as the prefill and decode workers run them;
- a prefill and a decode worker (`phasefleet worker` processes, phasefleet.local.fleet.Fleet):
  pulls of leased KV over a bare-socket GET (bench/kv_bandwidth.py, as the decode worker reads
  it), and the decode worker's own pulls of prompts sent through the router (its metrics), with
  the client's gap between the first token (from the prefill worker) and the second (after the
  pull, the copy to the device and one decode step);
- one loopback TCP socket moving the same bytes, the baseline (kv_bandwidth.socket_seconds).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from gpu_models import kv_layout_8b
from gpu_report import CheckContext, Status
from kv_bandwidth import handoff_totals, socket_seconds, stream_kv
from stream_client import stream_completion

from phasefleet.local.fleet import Fleet, FleetConfig, free_port

BLOCK = 16
NAME = "kv-layout"


def runner_copies(folder: Path, device: str, tokens: int) -> dict[str, Any]:
    """read_kv and write_kv of `tokens` tokens' blocks on one model runner, best of 3 each."""
    from transformers import AutoConfig

    from phasefleet.engine.model_runner import ModelRunner

    runner = ModelRunner(
        folder, AutoConfig.from_pretrained(folder), "bfloat16", torch.device(device), BLOCK, 4096
    )
    blocks = -(-tokens // BLOCK)
    runner.allocate_kv(blocks + 1)
    for keys, values in runner.kv_caches:
        keys.normal_()
        values.normal_()
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    ids = list(range(1, blocks + 1))
    nbytes = runner.kv_layout().payload_bytes(blocks)
    buffer = bytearray(nbytes)
    reads, writes = [], []
    for _ in range(3):
        t = time.perf_counter()
        offset = 0
        for chunk in runner.read_kv(ids):
            buffer[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        reads.append(time.perf_counter() - t)
        for keys, values in runner.kv_caches:
            keys.zero_()
            values.zero_()
        t = time.perf_counter()
        runner.write_kv(ids, torch.frombuffer(buffer, dtype=torch.uint8))
        if device == "cuda":
            torch.cuda.synchronize()
        writes.append(time.perf_counter() - t)
    same = all(  # block 0, the null block, is not part of the hand-off
        torch.equal(k[1:], sk[1:]) and torch.equal(v[1:], sv[1:])
        for (k, v), (sk, sv) in zip(runner.kv_caches, saved, strict=True)
    )
    return {
        "bytes": nbytes,
        "read_kv_gbps": nbytes / min(reads) / 1e9,
        "write_kv_gbps": nbytes / min(writes) / 1e9,
        "round_trip_equal": same,
    }


def _worker_pulls(
    url: str, decode: str, prompts: list[list[int]]
) -> tuple[dict[str, Any], list[float]]:
    """Sends each prompt through the router (2 tokens); the decode worker's pull totals and the
    client's gap between the first and the second token of each."""

    async def run() -> tuple[dict[str, Any], list[float]]:
        async with httpx.AsyncClient(timeout=300) as client:
            before = await handoff_totals(client, decode)
            gaps = []
            for prompt in prompts:
                timing = await stream_completion(client, url, NAME, prompt, 2, time.perf_counter())
                if not timing.ok or len(timing.token_times) < 2:
                    raise RuntimeError(f"request through the router failed: {timing.error}")
                gaps.append(timing.gaps()[0][1])
            totals = (await handoff_totals(client, decode)) - before
        return vars(totals), gaps

    return asyncio.run(run())


def handoff(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    folder = kv_layout_8b(ctx)
    tokens, pulls = (2048, 3) if not ctx.quick else (64, 1)
    data["prompt_tokens"] = tokens
    data["runner"] = runner_copies(folder, ctx.device, tokens)
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    blocks = -(-tokens // BLOCK)
    worker_args = ["--device", ctx.device, "--dtype", "bfloat16", "--max-model-len", "4096"]
    worker_args += ["--num-kv-blocks", str(4 * blocks + 64), "--max-num-seqs", "8"]
    worker_args += ["--remote-prefill-min-tokens", "0"]  # every prompt is handed off
    fleet = Fleet(
        FleetConfig(
            model=str(folder),
            served_model_name=NAME,
            port=free_port(),
            pools={"prefill": 1, "decode": 1},
            run_dir=ctx.work / "handoff-fleet",
            worker_args=worker_args,
            router_args=["--log-level", "warning"],
            drain_timeout=5.0,
        )
    )
    started = time.perf_counter()
    fleet.start()
    data["fleet_start_seconds"] = time.perf_counter() - started
    try:
        prompt = [10 + (i * 104729) % 490 for i in range(tokens)]
        rows = []
        prefill_url = fleet.workers["prefill"][0].url
        for i in range(pulls):
            prompt[0] = 10 + i  # no prefix-cache hit on the prefill worker
            pull = stream_kv(prefill_url, fleet.token, prompt)
            sock = min(socket_seconds(pull.tail_bytes) for _ in range(2))
            rows.append(
                {
                    "bytes": pull.nbytes,
                    "pull_gbps": pull.gbps,  # the KV after the first token, over its time
                    "socket_gbps": pull.tail_bytes / sock / 1e9,
                }
            )
        data["pulls"] = rows
        prompts = [[100 + i] + prompt[1:] for i in range(pulls)]
        decode = fleet.workers["decode"][0].url
        totals, gaps = _worker_pulls(fleet.url, decode, prompts)
    finally:
        fleet.stop()
    data["decode_worker"] = totals
    data["second_token_gap_s"] = gaps
    # the decode worker times whole streams, the prefill included: a rate, not a bandwidth
    worker_gbps = totals["nbytes"] / totals["seconds"] / 1e9 if totals["seconds"] else None
    data["decode_worker"]["gbps"] = worker_gbps
    pull_gbps = statistics.median(r["pull_gbps"] for r in rows)
    socket_gbps = statistics.median(r["socket_gbps"] for r in rows)
    r = data["runner"]
    summary = (
        f"stream after the first token {pull_gbps:.3g} GB/s, decode worker's streams with "
        f"their prefill {worker_gbps or 0:.3g} GB/s, "
        f"loopback socket {socket_gbps:.3g} GB/s; read_kv {r['read_kv_gbps']:.3g}, write_kv "
        f"{r['write_kv_gbps']:.3g} GB/s"
    )
    problems = []
    if not r["round_trip_equal"]:
        problems.append("read_kv then write_kv changed the blocks")
    if totals["pulls"] != pulls or totals["failures"] or totals["local"]:
        problems.append(f"decode worker: {totals}")
    if problems:
        return Status.FAILED, f"{summary}; {'; '.join(problems)}"
    return (Status.OK if ctx.device == "cuda" else Status.NOT_APPLICABLE), summary
