"""An engine that raises does not take the worker down.

The worker runs in-process (uvicorn on a free localhost port, in a thread) around the real engine
with one fault injected: the next `fail_steps` calls of `step()` raise. That is the only fake.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine, RequestOutput
from phasefleet.server.app import build_app
from phasefleet.server.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine
from phasefleet.server.metrics import WorkerMetrics
from phasefleet.server.state import WorkerState
from tests.server.worker_proc import free_port


class FaultyEngine(LLMEngine):
    fail_steps = 0  # how many of the next steps raise
    steps_failed = 0

    def step(self) -> list[RequestOutput]:
        if self.fail_steps > 0:
            self.fail_steps -= 1
            self.steps_failed += 1
            raise RuntimeError("injected fault")
        return super().step()


@dataclass
class InProcessWorker:
    base_url: str
    state: WorkerState
    engine: FaultyEngine
    fatal: list[BaseException]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture
def worker(tiny_model: Path) -> Iterator[InProcessWorker]:
    engines: list[FaultyEngine] = []
    fatal: list[BaseException] = []

    def make_engine() -> FaultyEngine:
        engines.append(FaultyEngine(EngineConfig(model=str(tiny_model), device="cpu")))
        return engines[-1]

    engine = AsyncEngine(make_engine, max_queue_len=8, on_fatal=fatal.append)
    state = WorkerState(
        engine=engine,
        tokenizer=AutoTokenizer.from_pretrained(tiny_model),
        vocab_size=512,
        served_model_name="tiny",
        model_path=str(tiny_model),
        role="both",
        metrics=WorkerMetrics("tiny", "both", engine.stats),
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not (server.started and engine.ready):
        assert time.monotonic() < deadline, "in-process worker did not start"
        time.sleep(0.05)
    try:
        yield InProcessWorker(base_url, state, engines[0], fatal)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def complete(worker: InProcessWorker, **kwargs: Any) -> Any:
    return worker.client().completions.create(
        model="tiny", prompt="hello", max_tokens=4, extra_body={"ignore_eos": True}, **kwargs
    )


def wait_until_idle(worker: InProcessWorker) -> None:
    """After a failed step the engine steps once more to hand out the abort outputs; a fault
    armed before that step would be spent on it instead of on the next request."""
    deadline = time.monotonic() + 10
    while worker.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def test_failed_step_fails_its_requests_with_500_and_the_worker_recovers(
    worker: InProcessWorker,
) -> None:
    worker.engine.fail_steps = 1
    with pytest.raises(openai.InternalServerError) as err:
        complete(worker)
    assert err.value.status_code == 500
    assert err.value.code == "engine_error"
    assert "injected fault" in err.value.message

    # Streaming: the 200 headers are out, so the error arrives in-band, then [DONE].
    wait_until_idle(worker)
    worker.engine.fail_steps = 1
    with httpx.stream(
        "POST",
        f"{worker.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True},
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert '"code":"engine_error"' in lines[0].replace(" ", "")
    assert lines[-1] == "data: [DONE]"

    assert complete(worker).choices[0].finish_reason == "length"
    assert httpx.get(f"{worker.base_url}/health").status_code == 200
    assert worker.state.engine.stats().kv_cache_usage == 0  # type: ignore[union-attr]
    assert worker.fatal == []


def test_engine_broken_for_good_turns_unhealthy_and_calls_on_fatal(
    worker: InProcessWorker,
) -> None:
    worker.engine.fail_steps = 1000
    with pytest.raises(openai.InternalServerError):
        complete(worker)
    deadline = time.monotonic() + 10
    while not worker.fatal:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # The failed request's abort output keeps the engine stepping: every step fails.
    assert worker.engine.steps_failed == MAX_CONSECUTIVE_STEP_FAILURES
    health = httpx.get(f"{worker.base_url}/health")
    assert health.status_code == 503
    assert health.json() == {"status": "engine_failed"}
    with pytest.raises(openai.APIStatusError) as refused:
        complete(worker)
    assert refused.value.status_code == 503
