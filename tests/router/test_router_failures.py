"""The router when workers fail, fill up or are missing, over real processes and HTTP.

A worker killed before the first token: the request is retried on another worker. Killed after
it: that stream ends with an error event and the other streams finish. Every worker full: 429
with Retry-After. No worker: 503 naming the pool.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.router.router_proc import run_router, worker_list
from tests.server.worker_proc import Worker, free_port, run_worker

PROMPT = "A worker may fail at any time"
# One request runs and one waits; the next gets 429.
SMALL = ("--max-num-seqs", "1", "--max-queue-len", "1")
LONG: dict[str, Any] = {"temperature": 0, "max_tokens": 1500, "extra_body": {"ignore_eos": True}}
RETRIES = 'phasefleet_router_retries_total{model_name="tiny",role="router"}'


@pytest.fixture(scope="module")
def pair(tiny_model: Path) -> Iterator[tuple[Worker, Worker]]:
    with run_worker(tiny_model, *SMALL) as b, run_worker(tiny_model, *SMALL) as c:
        yield b, c


@pytest.fixture
def doomed(tiny_model: Path) -> Iterator[Worker]:
    with run_worker(tiny_model, *SMALL) as w:
        yield w


def kill(worker: Worker) -> None:
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(timeout=10)


def running(worker: Worker) -> float:
    return worker.metric("phasefleet_num_requests_running")


def test_worker_killed_before_the_first_token_is_retried_elsewhere(
    doomed: Worker, pair: tuple[Worker, Worker]
) -> None:
    healthy = pair[0]
    # A long refresh interval: the router still believes in the killed worker.
    args = ("--workers", worker_list(doomed, healthy), "--policy", "round-robin")
    with run_router(*args, "--refresh-interval", "600") as router:
        kill(doomed)
        client = router.client()
        greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 6}
        expected = healthy.client().completions.create(model="tiny", prompt=PROMPT, **greedy)
        for _ in range(2):  # round-robin: one of these is sent to the dead worker first
            res = client.completions.create(model="tiny", prompt=PROMPT, **greedy)
            assert res.choices[0].text == expected.choices[0].text
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(model="tiny", prompt=PROMPT, stream=True, **greedy)
        )
        assert text == expected.choices[0].text
        assert router.metrics()[RETRIES] == 1  # then the dead worker is skipped


@pytest.mark.parametrize("stream", [False, True])
def test_worker_killed_while_the_request_waits_in_its_queue(
    doomed: Worker, pair: tuple[Worker, Worker], stream: bool
) -> None:
    healthy = pair[0]
    healthy.wait_until(lambda: running(healthy) == 0)
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 6}
    expected = healthy.client().completions.create(model="tiny", prompt=PROMPT, **greedy)
    filler = doomed.client().completions.create(model="tiny", prompt=PROMPT, stream=True, **LONG)
    args = ("--workers", worker_list(doomed, healthy), "--policy", "round-robin")
    try:
        doomed.wait_until(lambda: running(doomed) == 1)
        with run_router(*args) as router:
            client = router.client()
            texts: list[str] = []

            def ask() -> None:
                res = client.completions.create(
                    model="tiny", prompt=PROMPT, stream=stream, **greedy
                )
                if stream:
                    texts.append("".join(c.choices[0].text for c in res))  # type: ignore[union-attr]
                else:
                    texts.append(res.choices[0].text)  # type: ignore[union-attr]

            for _ in range(2):  # round-robin: one of two lands on the doomed worker
                asking = threading.Thread(target=ask)
                asking.start()
                queued = False
                while asking.is_alive() and not queued:
                    queued = doomed.metric("phasefleet_num_requests_waiting") == 1
                    time.sleep(0.02)
                if queued:
                    break
                asking.join()
            assert queued, "no request was queued on the doomed worker"
            kill(doomed)  # the request waits there: no token has reached the client
            asking.join(timeout=60)
            assert texts[-1] == expected.choices[0].text
            assert router.metrics()[RETRIES] == 1
    finally:
        filler.close()


def test_worker_killed_mid_stream_ends_only_that_stream(
    doomed: Worker, pair: tuple[Worker, Worker]
) -> None:
    healthy = pair[0]
    args = ("--workers", worker_list(doomed, healthy), "--policy", "round-robin")
    with run_router(*args) as router:
        client = router.client()
        streams = []
        for _ in range(2):
            streams.append(
                client.completions.create(model="tiny", prompt=PROMPT, stream=True, **LONG)
            )
            next(iter(streams[-1]))
            if len(streams) == 1:
                first_on_doomed = running(doomed) == 1
        first, second = (iter(s) for s in streams)
        # Round-robin put the two streams on different workers.
        assert running(doomed) == 1 and running(healthy) == 1
        victim, survivor = (first, second) if first_on_doomed else (second, first)
        kill(doomed)
        with pytest.raises(openai.APIError, match="the worker serving this stream failed"):
            for _ in victim:
                pass
        # The other stream goes on: tokens keep arriving after the kill.
        assert sum(1 for _, _ in zip(range(50), survivor, strict=False)) == 50
        assert running(healthy) == 1
        for stream in streams:
            stream.close()
        healthy.wait_until(lambda: running(healthy) == 0)


def test_all_workers_full_answers_429_with_retry_after(pair: tuple[Worker, Worker]) -> None:
    streams = []
    try:
        for worker in pair:  # one running, one waiting on each: both queues are full
            for gauge in ("running", "waiting"):
                streams.append(
                    worker.client().completions.create(
                        model="tiny", prompt=PROMPT, stream=True, **LONG
                    )
                )
                worker.wait_until(
                    lambda w=worker, g=gauge: w.metric(f"phasefleet_num_requests_{g}") == 1  # type: ignore[misc]
                )
        with run_router("--workers", worker_list(*pair)) as router:
            with pytest.raises(openai.RateLimitError) as caught:
                router.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
            assert caught.value.status_code == 429
            assert int(caught.value.response.headers["retry-after"]) >= 1
            error = caught.value.response.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "pool 'worker'" in error["message"]
    finally:
        for stream in streams:
            stream.close()


def test_no_ready_worker_answers_503_naming_the_pool() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with run_router("--workers", nobody) as router:
        assert httpx.get(f"{router.base_url}/health").json()["ready_workers"] == {"worker": 0}
        assert [m.id for m in router.client().models.list().data] == ["tiny"]
        tokenize = httpx.post(f"{router.base_url}/tokenize", json={"prompt": PROMPT})
        assert tokenize.status_code == 503
        assert tokenize.json()["error"]["code"] == "no_ready_worker"
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as caught:
                router.client().completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=4, stream=stream
                )
            assert caught.value.status_code == 503
            assert caught.value.response.headers["retry-after"] == "1"
            error = caught.value.response.json()["error"]
            assert error["message"] == f"no ready worker in pool 'worker' ({nobody})"
            assert error["type"] == "service_unavailable"
            assert error["code"] == "no_ready_worker"


def test_a_client_that_leaves_aborts_its_request_on_the_worker(pair: tuple[Worker, Worker]) -> None:
    worker = pair[1]
    worker.wait_until(lambda: running(worker) == 0)
    with run_router("--workers", worker.base_url) as router:
        started = time.monotonic()  # how long the whole answer takes on this machine now
        router.client().completions.create(model="tiny", prompt=PROMPT, **LONG)
        impatient = router.client(timeout=(time.monotonic() - started) / 5)
        generated = worker.counter("phasefleet_generation_tokens_total")
        with pytest.raises(openai.APITimeoutError):  # non-streaming: the client gives up
            impatient.completions.create(model="tiny", prompt=PROMPT, **LONG)
        worker.wait_until(lambda: running(worker) == 0, timeout=5)
        # The worker stopped the request when the client left, short of its 1500 tokens.
        assert worker.counter("phasefleet_generation_tokens_total") - generated < 1500
        stream = router.client().completions.create(
            model="tiny", prompt=PROMPT, stream=True, **LONG
        )
        next(iter(stream))
        assert running(worker) == 1
        stream.close()
        worker.wait_until(lambda: running(worker) == 0, timeout=5)
