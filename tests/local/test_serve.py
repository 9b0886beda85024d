"""`phasefleet serve`: a local fleet behind one port, run as a user would run it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from phasefleet.local.fleet import check_port, free_port
from tests.server.worker_proc import run_worker

STARTUP_TIMEOUT = 240.0  # seconds: three processes load the model on a shared 2-core machine


def children_of(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def ctrl_c_leaves_nothing(
    proc: subprocess.Popen[bytes], fleet: list[int], output: Callable[[], str]
) -> None:
    """SIGINT (what Ctrl-C sends): serve exits 0 and none of its `fleet` processes is left."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, output()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in fleet) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in fleet if alive(pid)] == []


def test_serve_answers_like_one_worker_and_ctrl_c_leaves_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    cmd = [  # --port 0: serve picks a free port and prints it
        sys.executable, "-m", "phasefleet.cli", "serve", "--model", str(tiny_model),
        "--served-model-name", "tiny", "--port", "0", "--run-dir", str(tmp_path),
        "--worker-args", "--num-kv-blocks 64 --remote-prefill-min-tokens 0",
    ]  # fmt: skip
    log = (tmp_path / "serve.out").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while "PhaseFleet is serving" not in (tmp_path / "serve.out").read_text():
            assert proc.poll() is None, (tmp_path / "serve.out").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.out").read_text()
            time.sleep(0.5)
        banner = (tmp_path / "serve.out").read_text()
        url = re.search(r"http://127\.0\.0\.1:(\d+)/v1", banner)
        assert url is not None and "curl" in banner, banner
        port = int(url.group(1))
        assert port != 0
        fleet = children_of(proc.pid)
        assert len(fleet) >= 3  # router, prefill worker, decode worker
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        prompt = "The harbour lights came on one by one " * 3
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        with run_worker(tiny_model, "--num-kv-blocks", "64") as reference:
            want = reference.client().completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0
            )
        assert got.choices[0].text == want.choices[0].text
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'role="router"' in metrics
        ctrl_c_leaves_nothing(proc, fleet, lambda: (tmp_path / "serve.out").read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_serve_refuses_a_folder_without_a_model(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "phasefleet.cli", "serve", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "model must be a Hugging Face model folder" in out.stderr


def test_serve_refuses_a_taken_port_before_any_worker_starts(
    tiny_model: Path, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [
            sys.executable, "-m", "phasefleet.cli", "serve", "--model", str(tiny_model),
            "--port", str(port), "--run-dir", str(tmp_path),
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"phasefleet serve: port {port} on 127.0.0.1 is taken: stop what listens there, or"
        " choose another --port (--port 0 picks a free one)"
    ]
    assert list(tmp_path.iterdir()) == []  # no worker was started (none wrote a log)


def test_check_port_passes_a_free_port_and_names_a_taken_one() -> None:
    check_port("127.0.0.1", free_port())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 0.0.0.0 is taken"):
            check_port("0.0.0.0", port)  # the wildcard address overlaps 127.0.0.1
