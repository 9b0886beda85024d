"""An engine that raises does not take the worker down; a request that fails takes only itself.

The worker runs in-process (uvicorn on a free localhost port, in a thread) around the real engine
with faults injected on demand: the next `fail_steps` calls of `step()` raise, the next
`fail_adds` requests cannot be set up, the next added request is broken (`poison`), or a step
hangs (`hang`). The engine's clock is real time plus an offset the test moves.
"""

from __future__ import annotations

import asyncio
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

STALL_TIMEOUT = 30.0  # seconds, on the engine's clock


class FaultyEngine(LLMEngine):
    fail_steps = 0  # how many of the next steps raise
    steps_failed = 0
    fail_adds = 0  # how many of the next requests fail in add_request (not a bad value)
    poison: str | None = None  # the next added request gets this fault: "nan" or "detokenizer"
    hang: threading.Event | None = None  # the next step waits for this event

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.hanging = threading.Event()  # set while a step hangs

    def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        if self.fail_adds > 0:
            self.fail_adds -= 1
            raise RuntimeError("injected setup fault")
        super().add_request(request_id, *args, **kwargs)
        if self.poison == "nan":  # the distribution turns NaN, as top_p=5e-324 once made it
            self._live[request_id].row.params.temperature = float("nan")
        elif self.poison == "detokenizer":
            self._live[request_id].detok.update = _raise  # type: ignore[method-assign,assignment]
        self.poison = None

    def step(self) -> list[RequestOutput]:
        if self.hang is not None:
            hang, self.hang = self.hang, None
            self.hanging.set()
            assert hang.wait(60), "the test never released the hung step"
            self.hanging.clear()
        if self.fail_steps > 0:
            self.fail_steps -= 1
            self.steps_failed += 1
            raise RuntimeError("injected fault")
        return super().step()


def _raise(*_: object) -> None:
    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")


@dataclass
class InProcessWorker:
    base_url: str
    state: WorkerState
    engine: FaultyEngine
    fatal: list[BaseException]
    clock_offset: list[float]  # seconds added to time.monotonic() on the engine's clock

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0)

    def health(self, path: str = "/health") -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", timeout=1.0)  # Kubernetes' default probe


@pytest.fixture
def worker(tiny_model: Path) -> Iterator[InProcessWorker]:
    engines: list[FaultyEngine] = []
    fatal: list[BaseException] = []

    def make_engine() -> FaultyEngine:
        engines.append(FaultyEngine(EngineConfig(model=str(tiny_model), device="cpu")))
        return engines[-1]

    clock_offset = [0.0]
    engine = AsyncEngine(
        make_engine,
        max_queue_len=8,
        on_fatal=fatal.append,
        stall_timeout=STALL_TIMEOUT,
        clock=lambda: time.monotonic() + clock_offset[0],
    )
    state = WorkerState(
        engine=engine,
        tokenizer=AutoTokenizer.from_pretrained(tiny_model),
        vocab_size=512,
        served_model_name="tiny",
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
        yield InProcessWorker(base_url, state, engines[0], fatal, clock_offset)
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


def stream_tokens(worker: InProcessWorker, **body: Any) -> list[int]:
    """A seeded sampling stream's output token ids, read to the end."""
    chunks = worker.client().completions.create(
        model="tiny", stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}, **body
    )
    return [t for chunk in chunks for t in (chunk.choices[0].model_extra or {})["token_ids"]]


def running(worker: InProcessWorker) -> int:
    stats = worker.state.engine.stats()
    return 0 if stats is None else stats.num_running


@pytest.mark.parametrize("fault", ["nan", "detokenizer"])
def test_a_request_that_fails_alone_gets_500_and_its_neighbours_are_untouched(
    worker: InProcessWorker, fault: str
) -> None:
    long: dict[str, Any] = dict(prompt="a long neighbour", max_tokens=600, seed=11)
    reference = stream_tokens(worker, **long)
    neighbour: list[list[int]] = []
    thread = threading.Thread(target=lambda: neighbour.append(stream_tokens(worker, **long)))
    thread.start()
    deadline = time.monotonic() + 30
    while running(worker) == 0 and thread.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)

    worker.engine.poison = fault
    with pytest.raises(openai.InternalServerError) as err:
        complete(worker, seed=3, temperature=1.0)
    assert err.value.code == "request_failed"
    assert err.value.status_code == 500
    # Streaming: the error arrives in-band, then [DONE]; the neighbour is still running.
    worker.engine.poison = fault
    with httpx.stream(
        "POST",
        f"{worker.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True},
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert '"code":"request_failed"' in lines[-2].replace(" ", "")
    assert lines[-1] == "data: [DONE]"
    assert thread.is_alive(), "the neighbour finished before the faults: make it longer"

    thread.join(timeout=120)
    assert neighbour == [reference]  # token for token
    assert worker.health().status_code == 200
    assert worker.state.engine.stats().kv_cache_usage == 0  # type: ignore[union-attr]
    assert worker.engine.steps_failed == 0 and worker.fatal == []


def test_a_request_whose_setup_fails_gets_500_and_the_worker_serves_on(
    worker: InProcessWorker,
) -> None:
    worker.engine.fail_adds = 1
    with pytest.raises(openai.InternalServerError) as err:
        complete(worker, n=2)
    assert err.value.code == "request_failed"
    assert "injected setup fault" in err.value.message
    assert complete(worker).choices[0].finish_reason == "length"
    assert not worker.engine.has_unfinished_requests()
    assert worker.health().status_code == 200 and worker.fatal == []


def test_a_stuck_step_fails_liveness_and_readiness_until_it_moves(
    worker: InProcessWorker,
) -> None:
    assert worker.health("/health/live").json() == {"status": "alive"}
    release = threading.Event()
    worker.engine.hang = release
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(complete(worker)))
    thread.start()
    try:
        assert worker.engine.hanging.wait(30)
        assert worker.health("/health/live").status_code == 200  # busy, not yet stalled
        worker.clock_offset[0] += STALL_TIMEOUT + 1
        live = worker.health("/health/live")
        assert (live.status_code, live.json()) == (503, {"status": "engine_stalled"})
        ready = worker.health()
        assert (ready.status_code, ready.json()) == (503, {"status": "engine_stalled"})
        with pytest.raises(openai.APIStatusError) as refused:
            complete(worker)
        assert refused.value.status_code == 503 and refused.value.code == "engine_stalled"
    finally:
        release.set()
    thread.join(timeout=60)
    assert result[0].choices[0].finish_reason == "length"  # the stuck request finishes
    assert worker.health("/health/live").status_code == 200
    assert worker.health().status_code == 200


class GatedTokenizer:
    """The worker's tokenizer, held inside encode() until the test lets it go."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encoding = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        ids: list[int] = self.inner.encode(text, **kwargs)
        self.encoding.set()
        assert self.release.wait(60), "the test never released the tokenizer"
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_health_answers_while_a_32k_token_prompt_is_tokenized(worker: InProcessWorker) -> None:
    gate = GatedTokenizer(worker.state.tokenizer)
    worker.state.tokenizer = gate
    prompt = " hello world" * 16_000
    assert len(gate.inner.encode(prompt)) >= 32_000
    result: list[httpx.Response] = []
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    thread = threading.Thread(
        target=lambda: result.append(
            httpx.post(f"{worker.base_url}/v1/completions", json=body, timeout=60)
        )
    )
    thread.start()
    try:
        assert gate.encoding.wait(60)
        # The event loop is free: both probes answer within Kubernetes' default 1 s timeout.
        assert worker.health().status_code == 200
        assert worker.health("/health/live").status_code == 200
    finally:
        gate.release.set()
    thread.join(timeout=60)
    error = result[0].json()["error"]  # longer than the 2048-token context
    assert (result[0].status_code, error["param"]) == (400, "prompt")


def test_liveness_holds_while_loading_and_fails_when_loading_fails() -> None:
    loop = asyncio.new_event_loop()
    release = threading.Event()

    def make_engine() -> LLMEngine:
        assert release.wait(30)
        raise RuntimeError("no model today")

    engine = AsyncEngine(make_engine, max_queue_len=1)
    engine.start(loop)
    try:
        assert engine.liveness() is None and not engine.ready  # loading: alive, not ready
        release.set()
        assert engine._thread is not None
        engine._thread.join(30)
        assert engine.liveness() == "engine_failed"
    finally:
        release.set()
        loop.close()
