"""`phasefleet serve --autoscale --min prefill=0 --min decode=0`, run as a user would: both
pools idle to zero worker processes, the router holds the requests that come while they wake,
every one is answered in full, and the pools idle back to zero."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.local.test_autoscale_serve import STARTUP_TIMEOUT, Serve
from tests.local.test_serve import children_of, ctrl_c_leaves_nothing
from tests.server.worker_proc import free_port

IDLE_S = 3.0  # --scale-to-zero-after
MAX_TOKENS = 8
REQUESTS = 6


def serve_command(model: Path, port: int, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "phasefleet.cli", "serve", "--model", str(model),
        "--served-model-name", "tiny", "--port", str(port), "--run-dir", str(run_dir),
        "--router-args", "--refresh-interval 0.5",
        "--autoscale", "--min", "prefill=0", "--min", "decode=0",
        "--max", "prefill=1", "--max", "decode=1",
        "--interval", "1", "--signal-window", "2", "--scale-down-window", "0",
        "--scale-to-zero-after", str(IDLE_S),
    ]  # fmt: skip


def ask(port: int, i: int) -> httpx.Response:
    body = {
        "model": "tiny", "prompt": f"Wake up {i}", "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=240)


def test_serve_idles_to_zero_workers_and_wakes_for_held_requests(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = (tmp_path / "serve.out").open("wb")
    proc = subprocess.Popen(
        serve_command(tiny_model, port, tmp_path),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    serve = Serve(proc, tmp_path)

    def at_zero() -> bool:
        members = json.loads((tmp_path / "workers.json").read_text())
        return members == {"prefill": [], "decode": []} and len(children_of(proc.pid)) == 1

    try:
        asyncio.run(
            serve.until(lambda: "PhaseFleet is serving" in serve.output(), STARTUP_TIMEOUT, "fleet")
        )
        assert "autoscaling every 1s (prefill 0..1, decode 0..1" in serve.output()
        asyncio.run(serve.until(at_zero, 60, "both pools at zero (only the router left)"))
        with ThreadPoolExecutor(REQUESTS) as threads:
            answers = list(threads.map(lambda i: ask(port, i), range(REQUESTS)))
        assert [a.status_code for a in answers] == [200] * REQUESTS, [a.text for a in answers]
        assert all(a.json()["usage"]["completion_tokens"] == MAX_TOKENS for a in answers)
        out = serve.output()
        assert "decode 0->1: the router holds" in out
        assert "prefill 0->1: the router holds" in out
        asyncio.run(serve.until(at_zero, 60, "both pools back at zero"))
        assert "decode 1->0: no request for" in serve.output()
        ctrl_c_leaves_nothing(proc, children_of(proc.pid), serve.output)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
