"""Back-pressure and cleanup over real HTTP: the bounded queue (429), requests that can never be
served (400, 413), client disconnects.

The worker runs one request at a time (--max-num-seqs 1), queues at most one more
(--max-queue-len 1) and takes bodies up to 64 KiB, with role `decode` to check the metrics' role
label.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.worker_proc import Worker, run_worker

LONG: dict[str, Any] = {"ignore_eos": True}
MAX_BODY = 64 * 1024  # bytes


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[Worker]:
    with run_worker(
        tiny_model, "--max-num-seqs", "1", "--max-queue-len", "1", "--role", "decode",
        "--max-request-bytes", str(MAX_BODY),
    ) as w:  # fmt: skip
        yield w


def gauge(worker: Worker, name: str) -> float:
    return worker.metrics()[f'phasefleet_{name}{{model_name="tiny",role="decode"}}']


def pool_is_free(worker: Worker) -> bool:
    return (
        gauge(worker, "kv_cache_usage_perc") == 0
        and gauge(worker, "num_requests_running") == 0
        and gauge(worker, "num_requests_waiting") == 0
    )


def test_disconnect_mid_stream_frees_kv_blocks(worker: Worker) -> None:
    client = worker.client(timeout=60)
    stream = client.completions.create(
        model="tiny", prompt="A long answer", max_tokens=1500, stream=True, extra_body=LONG
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert gauge(worker, "kv_cache_usage_perc") > 0
    assert gauge(worker, "num_requests_running") == 1
    stream.close()  # drops the connection mid-stream
    worker.wait_until(lambda: pool_is_free(worker))
    # The worker is still healthy and serves the next request.
    res = client.completions.create(model="tiny", prompt="again", max_tokens=3, extra_body=LONG)
    assert res.choices[0].finish_reason == "length"


def test_disconnect_while_waiting_for_a_whole_response_frees_kv_blocks(worker: Worker) -> None:
    body = {"model": "tiny", "prompt": "A long answer", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.base_url}/v1/completions", json=body, timeout=1.0)
    worker.wait_until(lambda: pool_is_free(worker))


def test_full_queue_answers_429_with_retry_after(worker: Worker) -> None:
    client = worker.client(timeout=60)
    running = client.completions.create(
        model="tiny", prompt="first", max_tokens=1500, stream=True, extra_body=LONG
    )
    next(iter(running))  # scheduled: it holds the only running slot
    queued_stream: list[Any] = []

    def queue_one() -> None:
        queued_stream.append(
            client.completions.create(
                model="tiny", prompt="second", max_tokens=1500, stream=True, extra_body=LONG
            )
        )

    thread = threading.Thread(target=queue_one)
    thread.start()
    worker.wait_until(lambda: gauge(worker, "num_requests_waiting") == 1)

    response = httpx.post(
        f"{worker.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "third", "max_tokens": 2},
    )
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert error["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )

    thread.join(timeout=60)
    # A queued client that gives up leaves the queue; the running request is untouched.
    queued_stream[0].close()
    worker.wait_until(lambda: gauge(worker, "num_requests_waiting") == 0)
    assert gauge(worker, "num_requests_running") == 1
    # With the queue free again, a new request is admitted and waits for the slot.
    waiting = client.completions.create(
        model="tiny", prompt="fourth", max_tokens=3, stream=True, extra_body=LONG
    )
    running.close()
    assert [c.choices[0].finish_reason for c in waiting][-1] == "length"
    worker.wait_until(lambda: pool_is_free(worker))
    assert httpx.get(f"{worker.base_url}/health").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": "hi", "n": 2}, "n"),
        ("completions", {"prompt": ["a", "b"]}, "prompt"),
        ("completions", {"prompt": [[1, 2], [3]], "n": 1}, "prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ],
)
def test_more_requests_than_the_queue_holds_is_400_not_429(
    worker: Worker, path: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{worker.base_url}/v1/{path}", json={"model": "tiny", "max_tokens": 2, **body}
    )
    error = error_of(response, 400)
    assert error["param"] == param
    assert "waiting queue (1)" in error["message"]


def test_a_body_over_the_limit_is_413(worker: Worker) -> None:
    body = {"model": "tiny", "prompt": "x" * MAX_BODY, "max_tokens": 2}
    error = error_of(httpx.post(f"{worker.base_url}/v1/completions", json=body), 413)
    assert error["code"] == "request_too_large"
    assert str(MAX_BODY) in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"y" * 1024
        yield b'"}]}'

    response = httpx.post(f"{worker.base_url}/v1/chat/completions", content=chunks())
    assert "content-length" not in response.request.headers
    assert error_of(response, 413)["code"] == "request_too_large"
    # A body within the limit is served.
    ok = {"model": "tiny", "prompt": [1] * 100, "max_tokens": 2}
    assert httpx.post(f"{worker.base_url}/v1/completions", json=ok).status_code == 200
