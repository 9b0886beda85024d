"""A worker process's life: graceful drain on SIGTERM, loud non-zero exit on a broken engine."""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.worker_proc import run_worker


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_model: Path) -> None:
    with run_worker(tiny_model) as worker:
        client = worker.client(timeout=120)
        stream = client.completions.create(
            model="tiny",
            prompt="drain me",
            max_tokens=600,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        chunks = iter(stream)
        received: list[Any] = [next(chunks)]
        reader = threading.Thread(target=lambda: received.extend(chunks))
        reader.start()

        worker.proc.send_signal(signal.SIGTERM)
        worker.wait_until(lambda: httpx.get(f"{worker.base_url}/health").status_code == 503)
        assert httpx.get(f"{worker.base_url}/health").json() == {"status": "draining"}
        live = httpx.get(f"{worker.base_url}/health/live")  # not ready, but not to be restarted
        assert (live.status_code, live.json()) == (200, {"status": "alive"})
        refused = httpx.post(
            f"{worker.base_url}/v1/completions",
            json={"model": "tiny", "prompt": "too late", "max_tokens": 2},
        )
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"

        reader.join(timeout=120)
        assert worker.proc.wait(timeout=60) == 0
        token_ids = [t for chunk in received for t in chunk.choices[0].model_extra["token_ids"]]
        assert len(token_ids) == 600  # the in-flight request ran to the end
        assert received[-1].choices[0].finish_reason == "length"


def test_engine_that_cannot_load_exits_non_zero(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    termination_log = tmp_path / "termination-log"
    monkeypatch.setenv("PHASEFLEET_TERMINATION_LOG", str(termination_log))
    with run_worker(broken, wait_healthy=False) as worker:
        assert worker.proc.wait(timeout=120) == 1
        assert "the engine failed" in worker.log()
    assert termination_log.read_text().startswith(f"the engine could not load model {broken} (")


def test_out_of_memory_at_load_is_the_termination_message(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KV pool far larger than this machine's memory: the allocator really refuses it."""
    termination_log = tmp_path / "termination-log"
    monkeypatch.setenv("PHASEFLEET_TERMINATION_LOG", str(termination_log))
    with run_worker(tiny_model, "--num-kv-blocks", str(10**9), wait_healthy=False) as worker:
        assert worker.proc.wait(timeout=120) == 1
    message = termination_log.read_text()
    assert message.startswith(f"out of memory loading model {tiny_model} (")
    assert message.count("\n") == 1
