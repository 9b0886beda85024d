"""`phasefleet serve` when a worker is killed as the OOM killer kills (SIGKILL), run as a user
would: the router keeps answering on the other workers, the worker comes back on its own and
rejoins; a worker that cannot come back makes serve stop with a message that names it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from tests.local.test_serve import alive, children_of, ctrl_c_leaves_nothing

STARTUP_TIMEOUT = 240.0  # seconds: the processes load the model on a shared 2-core machine
GENERATED = re.compile(r"^phasefleet_generation_tokens_total\{[^}]*\} (\S+)$", re.M)


class Serve:
    """A `phasefleet serve` process: its output, its router's worker file, its workers' pids."""

    def __init__(self, model: Path, run_dir: Path, *flags: str) -> None:
        cmd = [
            sys.executable, "-m", "phasefleet.cli", "serve", "--model", str(model),
            "--served-model-name", "tiny", "--port", "0", "--run-dir", str(run_dir),
            "--worker-args", "--num-kv-blocks 64 --remote-prefill-min-tokens 0",
            "--router-args", "--refresh-interval 0.5", *flags,
        ]  # fmt: skip
        self.run_dir = run_dir
        self.log = (run_dir / "serve.out").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.until(lambda: "PhaseFleet is serving" in self.output(), STARTUP_TIMEOUT, "banner")
        url = re.search(r"http://127\.0\.0\.1:\d+/v1", self.output())
        assert url is not None, self.output()
        self.url = url.group(0)

    def output(self) -> str:
        return (self.run_dir / "serve.out").read_text(errors="replace")

    def members(self, pool: str) -> list[str]:
        return list(json.loads((self.run_dir / "workers.json").read_text())[pool])

    def pid(self, url: str) -> int:
        """The pid of the fleet's process that listens on `url`'s port."""
        port = url.rsplit(":", 1)[1]
        for pid in children_of(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--port" in argv and argv[argv.index(b"--port") + 1].decode() == port:
                return pid
        raise AssertionError(f"no process of the fleet listens on {url}")

    def until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s:\n{self.output()}"
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.log.close()


class Sender:
    """Sends completions through the router one after another until stopped; keeps each
    outcome (the text, or the error)."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        self.results: list[str | Exception] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            prompt = f"Request {len(self.results)} about the harbour lights"
            try:
                done = self.client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=8, temperature=0
                )
                self.results.append(done.choices[0].text)
            except openai.APIError as exc:
                self.results.append(exc)

    def stop(self) -> list[str | Exception]:
        self._stop.set()
        self._thread.join(120)
        return self.results


def generated_tokens(worker_url: str) -> float:
    metrics = httpx.get(f"{worker_url}/metrics", timeout=10).text
    return sum(float(v) for v in GENERATED.findall(metrics))


def test_a_killed_decode_worker_is_restarted_and_rejoins_while_the_router_answers(
    tiny_model: Path, tmp_path: Path
) -> None:
    serve = Serve(tiny_model, tmp_path, "--prefill", "1", "--decode", "2")  # default back-off
    try:
        killed_url, other_url = serve.members("decode")
        killed = serve.pid(killed_url)
        sender = Sender(serve.url)
        serve.until(lambda: len(sender.results) >= 3, 60, "answers before the kill")
        os.kill(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        serve.until(lambda: serve.members("decode") == [other_url], 5, "worker out of the file")
        assert time.monotonic() - killed_at < 2.0  # the fleet looks every half second
        serve.until(lambda: len(serve.members("decode")) == 2, 120, "restarted worker")
        back_url = serve.members("decode")[1]
        assert back_url not in (killed_url, other_url)  # restarted on a new port
        back = serve.pid(back_url)
        assert back != killed and alive(back) and not alive(killed)
        answered = len(sender.results)
        serve.until(lambda: len(sender.results) >= answered + 6, 60, "answers after the restart")
        # the router sends the new process work once its own health check has seen it (six
        # answers of the tiny model can come sooner than that)
        serve.until(lambda: generated_tokens(back_url) > 0, 30, "work for the restarted worker")
        results = sender.stop()
        assert [r for r in results if isinstance(r, Exception)] == []
        assert all(isinstance(r, str) and r for r in results)
        out = serve.output()
        name = re.search(r"(decode-\d+) died \(killed by SIGKILL, after \d+s up; log ", out)
        assert name is not None, out
        assert "out of the router; restart 1 in 1s" in out
        assert f"restarting {name.group(1)} (restart 1, port {back_url.rsplit(':', 1)[1]})" in out
        assert f"{name.group(1)} joined ({back_url}; restart 1)" in out
        ctrl_c_leaves_nothing(serve.proc, children_of(serve.proc.pid), serve.output)
    finally:
        serve.close()


def test_a_worker_that_cannot_come_back_makes_serve_stop_and_name_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = shutil.copytree(tiny_model, tmp_path / "model")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    serve = Serve(model, run_dir, "--decode", "1", "--restart-backoff", "0.2", "--max-crashes", "3")
    try:
        fleet = children_of(serve.proc.pid)
        (model / "config.json").unlink()  # the model is gone: every restart fails to load it
        [decode_url] = serve.members("decode")
        os.kill(serve.pid(decode_url), signal.SIGKILL)
        assert serve.proc.wait(timeout=120) == 1, serve.output()
        out = serve.output()
        gave_up = re.search(
            r"phasefleet serve: giving up: (decode-\d+) crashed 3 times within 600s \(the last:"
            r" exit code 2, before it was ready, \d+s after it started\)", out
        )  # fmt: skip
        assert gave_up is not None, out
        after = out[gave_up.end() :]
        assert f"{gave_up.group(1)}.log" in after and "has no config.json" in after
        assert "restart 2 in 0.4s" in out  # the back-off doubled
        assert [pid for pid in fleet if alive(pid)] == []
    finally:
        serve.close()
