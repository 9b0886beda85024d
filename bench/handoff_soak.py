"""Soak: a trace segment through `phasefleet serve` (1 prefill + 2 decode workers, every prompt
handed off) for `--minutes`, while a loop SIGKILLs a random worker (as the OOM killer would)
every `--kill-every` seconds; serve restarts it. What it reports:

- requests lost: failed before their first token (the router re-sends those, so none should),
  ended after it with an error event (allowed: the client is told), or ended short with no
  error (never allowed), against requests answered in full;
- what is left once the load stops: each worker's KV blocks in use and leases (must be 0);
- each worker's resident memory over time, with the kills marked (a PNG next to the numbers).

    .venv/bin/python bench/handoff_soak.py --minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from stream_client import RequestTiming, stream_completion
from trace_segment import AZURE_CONV, load_segment

from phasefleet.engine.tiny import make_tiny

STARTUP_S = 240.0


@dataclass
class Soak:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    url: str = ""
    kills: list[tuple[float, str]] = field(default_factory=list)  # (seconds, worker)
    memory: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # MiB over time

    def output(self) -> str:
        return (self.run_dir / "serve.out").read_text(errors="replace")

    def workers(self) -> dict[str, list[str]]:
        return dict(json.loads((self.run_dir / "workers.json").read_text()))

    def processes(self) -> dict[str, int]:
        """Worker slot ('prefill-0', 'decode-1': a restart keeps its slot) or 'router' -> pid,
        for serve's live children (the slot is the name of the log its output goes to)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if int(stat[1]) != self.proc.pid or stat[0] == "Z":
                continue
            if "--role" not in argv:
                found["router"] = int(entry.name)
                continue
            try:
                found[Path(os.readlink(entry / "fd" / "1")).stem] = int(entry.name)
            except OSError:
                continue
        return found


def start(model: Path, run_dir: Path) -> Soak:
    cmd = [
        sys.executable, "-m", "phasefleet.cli", "serve", "--model", str(model),
        "--served-model-name", "tiny", "--port", "0", "--run-dir", str(run_dir),
        "--prefill", "1", "--decode", "2", "--max-crashes", "1000",
        "--worker-args", "--remote-prefill-min-tokens 0 --max-num-batched-tokens 256",
    ]  # fmt: skip
    with (run_dir / "serve.out").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    soak = Soak(proc, run_dir)
    deadline = time.monotonic() + STARTUP_S
    while "PhaseFleet is serving" not in soak.output():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start:\n{soak.output()}")
        time.sleep(0.5)
    found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", soak.output())  # the router's
    assert found is not None
    soak.url = found.group(1)
    return soak


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return None if found is None else int(found.group(1)) / 1024


async def sample_memory(soak: Soak, zero: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.perf_counter() - zero
        for name, pid in soak.processes().items():
            mib = rss_mib(pid)
            if mib is not None:
                soak.memory.setdefault(name, []).append((now, mib))
        await asyncio.sleep(5)


async def kill_loop(soak: Soak, every: float, zero: float, stop: asyncio.Event) -> None:
    rng = random.Random(1)
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            pass
        workers = {k: v for k, v in soak.processes().items() if k != "router"}
        if not workers:
            continue
        name = rng.choice(sorted(workers))
        subprocess.run(["kill", "-KILL", str(workers[name])], check=False)
        soak.kills.append((time.perf_counter() - zero, name))
        print(f"{time.perf_counter() - zero:7.1f} s: killed {name}", flush=True)


async def replay(soak: Soak, minutes: float, kill_every: float) -> list[tuple[int, RequestTiming]]:
    segment = load_segment(AZURE_CONV, 0.0, 120.0, 8.0, 512, 512, seed=3)  # tiny: vocab 512
    zero = time.perf_counter()
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(sample_memory(soak, zero, stop)),
        asyncio.create_task(kill_loop(soak, kill_every, zero, stop)),
    ]
    results: list[tuple[int, RequestTiming]] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(req_max: int, prompt: list[int], at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - zero)))
            timing = await stream_completion(client, soak.url, "tiny", prompt, req_max, zero)
            results.append((req_max, timing))

        requests = []
        loop_start = 0.0
        while loop_start < minutes * 60:
            for r in segment:
                if loop_start + r.offset < minutes * 60:
                    requests.append(one(r.max_tokens, r.prompt_token_ids, loop_start + r.offset))
            loop_start += 120.0
        print(f"{len(requests)} requests over {minutes:g} min", flush=True)
        await asyncio.gather(*requests)
    stop.set()
    await asyncio.gather(*tasks)
    return results


def leftovers(soak: Soak) -> dict[str, dict[str, float]]:
    """Each worker's KV blocks in use and leases, once nothing runs."""
    out = {}
    for pool, urls in soak.workers().items():
        for url in urls:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            values = {}
            for name in ("phasefleet_kv_cache_usage_perc", "phasefleet_kv_leases"):
                found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
                values[name] = float(found.group(1)) if found else 0.0
            out[f"{pool} {url}"] = values
    return out


def plot(soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, points in sorted(soak.memory.items()):
        ax.plot([t / 60 for t, _ in points], [m for _, m in points], label=name)
    for t, _ in soak.kills:
        ax.axvline(t / 60, color="grey", alpha=0.3, linewidth=0.8)
    ax.set_xlabel("minutes (grey: a worker SIGKILLed)")
    ax.set_ylabel("resident memory, MiB")
    ax.legend(fontsize=8)
    ax.set_title("hand-off soak: memory of each process of phasefleet serve")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds")
    p.add_argument("--plot", type=Path, default=Path(__file__).with_name("handoff_soak.png"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny(Path(tmp) / "tiny", arch="llama", seed=0)
        soak = start(model, Path(tmp))
        try:
            results = asyncio.run(replay(soak, args.minutes, args.kill_every))
            time.sleep(10)  # restarts settle; leases of cut streams end
            left = leftovers(soak)
        finally:
            soak.proc.send_signal(signal.SIGINT)
            try:
                soak.proc.wait(60)
            except subprocess.TimeoutExpired:
                soak.proc.kill()
        full = sum(1 for n, t in results if t.error is None and len(t.token_times) == n)
        before = [t for _, t in results if t.error is not None and not t.token_times]
        after = [t for _, t in results if t.error is not None and t.token_times]
        short = [t for n, t in results if t.error is None and len(t.token_times) != n]
        print(f"\nrequests {len(results)}: answered in full {full}")
        print(f"  failed before the first token: {len(before)}")
        print(f"  an error event after it: {len(after)}")
        print(f"  ended short without an error: {len(short)}")
        for t in (before + after)[:5]:
            print(f"    e.g. {t.error}")
        print(f"workers killed: {len(soak.kills)}")
        for name, values in left.items():
            print(f"left at the end, {name}: {values}")
        for name, points in sorted(soak.memory.items()):
            mibs = [m for _, m in points]
            print(
                f"memory {name}: first {mibs[0]:.0f} MiB, max {max(mibs):.0f}, last {mibs[-1]:.0f}"
            )
        plot(soak, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
