"""Property-based fuzzing of the worker's whole OpenAPI surface with schemathesis.

Every operation of the worker's own /openapi.json gets generated requests, schema-valid ones and
invalid ones, against a real worker process. None may get a 5xx (an in-band stream error counts
as one), the worker is healthy afterwards, and a seeded stream that runs again and again during
the fuzzing yields, every time, exactly the tokens it yields alone.

The schema is told what only the running worker knows: `model` is the served name (a random name
would stop nearly every request at the 404) and prompt token ids are within the vocabulary (else
nearly every token-id prompt stops at a 400). The context is 64 tokens so that no generated
request runs long; the example counts are fixed and generation is derandomized, so the run is the
same each time (about a minute on two cores).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.server.worker_proc import Worker, run_worker

EXAMPLES = {schemathesis.GenerationMode.POSITIVE: 60, schemathesis.GenerationMode.NEGATIVE: 40}
LONG_STREAM = {
    "model": "tiny",
    "prompt": "a stream that must not notice the fuzzing",
    "max_tokens": 40,
    "temperature": 1.0,
    "seed": 1234,
    "ignore_eos": True,
    "return_token_ids": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[Worker]:
    """With runtime LoRA loading, so its endpoints are fuzzed too (offline: a fuzzed repo id is
    looked up in the cache only), and a reasoning parser, so every chat answer is split."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    args = ("--max-model-len", "64", "--max-queue-len", "64")
    try:
        lora = ("--max-loras", "1", "--enable-runtime-lora")
        with run_worker(tiny_model, *args, *lora, "--reasoning-parser", "deepseek_r1") as w:
            yield w
    finally:
        mp.undo()


def served_model_schema(worker: Worker, vocab_size: int) -> Any:
    """The worker's OpenAPI schema, told what only the running worker knows: its model's name
    and, for most prompts, its vocabulary (else nearly every token-id prompt stops at a 400)."""
    raw = httpx.get(f"{worker.base_url}/openapi.json", timeout=10).json()
    for name, component in raw["components"]["schemas"].items():
        properties = component.get("properties", {})
        if "model" in properties and name.endswith("Request"):
            properties["model"] = {"type": "string", "enum": [worker.model]}
        for field in ("prompt", "input"):  # completions' prompt, embeddings' input
            if field in properties:
                _cap_token_ids(properties[field], vocab_size - 1)
    return schemathesis.openapi.from_dict(raw)


def _cap_token_ids(node: Any, maximum: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = maximum
        for child in node.values():
            _cap_token_ids(child, maximum)
    elif isinstance(node, list):
        for child in node:
            _cap_token_ids(child, maximum)


def stream_tokens(worker: Worker) -> list[int] | None:
    """The stream's output token ids; None if the queue was full (a fuzzed request may fill it)."""
    tokens: list[int] = []
    with httpx.stream(
        "POST", f"{worker.base_url}/v1/completions", json=LONG_STREAM, timeout=60
    ) as response:
        if response.status_code == 429:
            return None
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                assert "error" not in chunk, chunk
                tokens.extend(chunk["choices"][0]["token_ids"])
    return tokens


def test_fuzzed_requests_never_get_a_5xx_nor_disturb_a_running_stream(
    worker: Worker, tiny_model: Path
) -> None:
    vocab_size = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    schema = served_model_schema(worker, vocab_size)
    reference = stream_tokens(worker)
    assert reference is not None and len(reference) == LONG_STREAM["max_tokens"]

    fuzzing = threading.Event()
    fuzzing.set()
    streams: list[list[int]] = []
    stream_errors: list[BaseException] = []

    def stream_while_fuzzing() -> None:
        try:
            while fuzzing.is_set():
                tokens = stream_tokens(worker)
                if tokens is None:
                    time.sleep(0.05)  # 429: retry, as its Retry-After says
                else:
                    streams.append(tokens)
        except BaseException as exc:
            stream_errors.append(exc)

    streamer = threading.Thread(target=stream_while_fuzzing)
    streamer.start()
    server_errors: list[str] = []
    calls = [0]
    try:
        for mode, examples in EXAMPLES.items():

            @given(case=schema.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                derandomize=True,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case: Any) -> None:
                response = case.call(base_url=worker.base_url, timeout=60)
                calls[0] += 1
                if response.status_code >= 500 or "internal_server_error" in response.text:
                    server_errors.append(
                        f"{case.method} {case.path} {case.body!r:.300} -> "
                        f"{response.status_code} {response.text[:300]}"
                    )

            fuzz()
    finally:
        fuzzing.clear()
        streamer.join(timeout=120)
    # the worker's log holds the traceback of a 5xx (and is deleted with the worker)
    assert server_errors == [], worker.log()[-6000:]
    assert stream_errors == []
    assert calls[0] >= sum(EXAMPLES.values()) // 2
    assert len(streams) >= 2, "the stream did not run during the fuzzing"
    assert all(tokens == reference for tokens in streams)
    assert httpx.get(f"{worker.base_url}/health", timeout=5).json() == {"status": "ok"}
    assert httpx.get(f"{worker.base_url}/health/live", timeout=5).status_code == 200
    assert stream_tokens(worker) == reference
