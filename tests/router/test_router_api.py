"""The router's OpenAI surface over real localhost HTTP: two worker processes, one router process,
the official openai client. Greedy output through the router equals output straight from a worker.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from phasefleet.server.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from tests.router.router_proc import Router, run_router, worker_list
from tests.server.worker_proc import Worker, run_worker

PROMPT = "The router sends the prompt to the least loaded worker"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name one prime number."},
]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def workers(tiny_model: Path) -> Iterator[tuple[Worker, Worker]]:
    with run_worker(tiny_model) as a, run_worker(tiny_model) as b:
        yield a, b


@pytest.fixture(scope="module")
def router(workers: tuple[Worker, Worker]) -> Iterator[Router]:
    with run_router("--workers", worker_list(*workers), "--policy", "least-loaded") as r:
        yield r


@pytest.fixture(scope="module")
def prompt_ids(tiny_model: Path) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(tiny_model).encode(PROMPT))


@pytest.fixture(scope="module")
def via_router(router: Router) -> openai.OpenAI:
    return router.client()


@pytest.fixture(scope="module")
def direct(workers: tuple[Worker, Worker]) -> openai.OpenAI:
    return workers[0].client()


def test_health_and_models(router: Router, via_router: openai.OpenAI) -> None:
    health = httpx.get(f"{router.base_url}/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "ready_workers": {"worker": 2}}
    models = via_router.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert (models[0].model_extra or {})["max_model_len"] == 2048


def test_completion_equals_direct(via_router: openai.OpenAI, direct: openai.OpenAI) -> None:
    for _ in range(2):  # least-loaded alternates between the idle workers: both are checked
        routed = via_router.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
        straight = direct.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
        assert routed.choices[0].text == straight.choices[0].text
        assert routed.choices[0].finish_reason == "length"
        assert routed.usage == straight.usage


def test_completion_stream_equals_direct(via_router: openai.OpenAI, direct: openai.OpenAI) -> None:
    def run(client: openai.OpenAI) -> tuple[str, Any]:
        stream = client.completions.create(
            model="tiny", prompt=PROMPT, stream=True, stream_options={"include_usage": True},
            **GREEDY,
        )  # fmt: skip
        text, usage = "", None
        for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    routed, straight = run(via_router), run(direct)
    assert routed == straight
    assert routed[1] is not None and routed[1].completion_tokens == 8


def test_chat_equals_direct(via_router: openai.OpenAI, direct: openai.OpenAI) -> None:
    routed = via_router.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    straight = direct.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    assert routed.choices[0].message.content == straight.choices[0].message.content
    assert routed.usage == straight.usage


def test_chat_stream_equals_direct(via_router: openai.OpenAI, direct: openai.OpenAI) -> None:
    def run(client: openai.OpenAI) -> tuple[list[str | None], str]:
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True, **GREEDY
        )
        roles, text = [], ""
        for chunk in stream:
            for choice in chunk.choices:
                roles.append(choice.delta.role)
                text += choice.delta.content or ""
        return roles[:1], text

    routed, straight = run(via_router), run(direct)
    assert routed == straight
    assert routed[0] == ["assistant"]


def test_responses_equal_direct_whole_and_streamed(
    router: Router, via_router: openai.OpenAI, direct: openai.OpenAI
) -> None:
    """OpenAI's Responses API through the router: the same answer as from a worker, and a
    stream the router relays event for event (its first text delta is the first token the
    router times)."""

    def whole(client: openai.OpenAI) -> Any:
        return client.responses.create(
            model="tiny", input=PROMPT, instructions="Be terse.", max_output_tokens=8,
            temperature=0,
        )  # fmt: skip

    def streamed(client: openai.OpenAI) -> tuple[list[str], str, Any]:
        stream = client.responses.create(
            model="tiny", input=[{"role": "user", "content": PROMPT}], instructions="Be terse.",
            max_output_tokens=8, temperature=0, stream=True,
        )  # fmt: skip
        kinds: list[str] = []
        text, last = "", None
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            last = event
        return kinds, text, last

    first = router.counter("phasefleet_time_to_first_token_seconds_count")
    routed, straight = whole(via_router), whole(direct)
    assert routed.output_text == straight.output_text and routed.usage == straight.usage
    assert routed.status == "incomplete" and routed.incomplete_details.reason == "max_output_tokens"
    kinds, text, last = streamed(via_router)
    assert (kinds, text) == streamed(direct)[:2]
    assert text == routed.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert last.type == "response.incomplete" and last.response.output_text == text
    assert router.counter("phasefleet_time_to_first_token_seconds_count") == first + 1


def test_a_responses_function_call_through_the_router(
    router: Router, via_router: openai.OpenAI, direct: openai.OpenAI
) -> None:
    """An answer of a function call alone (no text): relayed whole and streamed, its arguments'
    delta the first token the router times."""
    tool: Any = {"type": "function", "name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False,
    }}  # fmt: skip
    kw: Any = {"model": "tiny", "input": PROMPT, "tools": [tool], "max_output_tokens": 20,
               "temperature": 0, "tool_choice": {"type": "function", "name": "pick"}}  # fmt: skip
    routed, straight = via_router.responses.create(**kw), direct.responses.create(**kw)
    assert routed.status == "completed" and routed.output[0].type == "function_call"
    assert [(i.type, i.arguments) for i in routed.output] == [
        (i.type, i.arguments) for i in straight.output
    ]
    first = router.counter("phasefleet_time_to_first_token_seconds_count")
    events = list(via_router.responses.create(**kw, stream=True))
    assert events[-1].type == "response.completed"
    assert "response.function_call_arguments.delta" in [e.type for e in events]
    assert router.counter("phasefleet_time_to_first_token_seconds_count") == first + 1


def test_bad_request_passes_through_unchanged(router: Router, workers: tuple[Worker, ...]) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "top_p": 1.5}
    routed = httpx.post(f"{router.base_url}/v1/completions", json=body)
    straight = httpx.post(f"{workers[0].base_url}/v1/completions", json=body)
    assert routed.status_code == straight.status_code == 400
    assert routed.json() == straight.json()
    assert routed.json()["error"]["param"] == "top_p"
    unknown = httpx.post(
        f"{router.base_url}/v1/completions", json={"model": "other", "prompt": PROMPT}
    )
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    malformed = httpx.post(
        f"{router.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["type"] == "invalid_request_error"
    retries = 'phasefleet_router_retries_total{model_name="tiny",role="router"}'
    assert router.metrics()[retries] == 0  # a bad request is not retried elsewhere


def test_user_seen_latency_metrics(router: Router, via_router: openai.OpenAI) -> None:
    def count(name: str) -> float:
        return router.metrics().get(f'{name}_count{{model_name="tiny",role="router"}}', 0.0)

    before = {
        n: count(f"phasefleet_{n}")
        for n in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                  "time_per_output_token_seconds", "e2e_request_latency_seconds")
    }  # fmt: skip
    stream = via_router.completions.create(model="tiny", prompt=PROMPT, stream=True, **GREEDY)
    events = sum(1 for _ in stream)  # up to 8: a token that ends mid-character sends nothing
    assert events > 1
    added = {n: count(f"phasefleet_{n}") - before[n] for n in before}
    assert added == {
        "time_to_first_token_seconds": 1,
        "inter_token_latency_seconds": events - 1,
        "time_per_output_token_seconds": 1,
        "e2e_request_latency_seconds": 1,
    }
    # The same buckets as the worker's histograms.
    samples = router.metrics()
    for name, buckets in [
        ("time_to_first_token_seconds", TTFT_BUCKETS),
        ("inter_token_latency_seconds", TOKEN_LATENCY_BUCKETS),
        ("time_per_output_token_seconds", TOKEN_LATENCY_BUCKETS),
        ("e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
    ]:
        bounds = [
            key.split('le="')[1].split('"')[0]
            for key in samples
            if key.startswith(f"phasefleet_{name}_bucket{{") and 'role="router"' in key
        ]
        assert bounds == [str(float(b)) for b in buckets] + ["+Inf"]


def test_concurrent_streams_all_complete(via_router: openai.OpenAI) -> None:
    """Streams at once through one router, spread over both workers: each gets its whole answer."""
    results: list[int] = []

    def one() -> None:
        stream = via_router.completions.create(
            model="tiny", prompt=PROMPT, stream=True, temperature=0, max_tokens=20,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                results.append(chunk.usage.completion_tokens)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [20] * 6


def test_prefix_aware_keeps_a_shared_prefix_on_one_worker(
    workers: tuple[Worker, Worker],
) -> None:
    def hits() -> list[float]:
        return [w.metric("phasefleet_prefix_cache_hits_total") for w in workers]

    def served() -> list[float]:
        return [w.metric("phasefleet_prompt_tokens_total") for w in workers]

    shared = "You are a careful assistant. Answer in one short sentence. " * 12  # ~700 chars
    with run_router("--workers", worker_list(*workers), "--policy", "prefix-aware") as router:
        client = router.client()
        hits_before, served_before = hits(), served()
        for question in ("What is a prime?", "Why is the sky blue?", "Name a river.", "Hi?"):
            client.completions.create(model="tiny", prompt=shared + question, max_tokens=2)
        new_hits = [after - before for after, before in zip(hits(), hits_before, strict=True)]
        new_tokens = [after - before for after, before in zip(served(), served_before, strict=True)]
    # Every request went to the worker that holds the prefix, and the later three hit its cache.
    assert sorted(new_tokens)[0] == 0
    assert max(new_hits) > 0 and min(new_hits) == 0


def test_logprobs_and_echo_equal_direct(
    via_router: openai.OpenAI, direct: openai.OpenAI, prompt_ids: list[int]
) -> None:
    def run(client: openai.OpenAI) -> tuple[Any, Any, list[Any]]:
        completion = client.completions.create(
            model="tiny", prompt=PROMPT, logprobs=2, echo=True, **GREEDY
        )
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY
        )
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, logprobs=True, stream=True, **GREEDY
        )
        streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
        return completion.choices[0].logprobs, chat.choices[0].logprobs, streamed

    routed, straight = run(via_router), run(direct)
    completion = routed[0]
    assert completion is not None and completion.token_logprobs is not None
    assert completion.token_logprobs[0] is None  # the echoed prompt's first token
    assert len(completion.token_logprobs) == len(prompt_ids) + 8
    assert routed[0].tokens == straight[0].tokens
    assert routed[0].token_logprobs == pytest.approx(straight[0].token_logprobs, abs=1e-4)
    assert routed[1] is not None and straight[1] is not None
    assert [e.token for e in routed[1].content] == [e.token for e in straight[1].content]
    assert len(routed[2]) == 8 and len(straight[2]) == 8


def test_tokenizer_version_and_models_through_the_router(
    router: Router, workers: tuple[Worker, Worker], prompt_ids: list[int]
) -> None:
    body = {"model": "tiny", "prompt": PROMPT}
    routed = httpx.post(f"{router.base_url}/tokenize", json=body)
    assert routed.status_code == 200
    assert routed.json() == httpx.post(f"{workers[0].base_url}/tokenize", json=body).json()
    assert routed.json()["tokens"] == prompt_ids
    chat = httpx.post(f"{router.base_url}/tokenize", json={"messages": MESSAGES})
    assert (
        chat.json()
        == httpx.post(f"{workers[1].base_url}/tokenize", json={"messages": MESSAGES}).json()
    )
    text = httpx.post(f"{router.base_url}/detokenize", json={"tokens": prompt_ids}).json()
    assert text == {"prompt": PROMPT}
    bad = httpx.post(f"{router.base_url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    version = httpx.get(f"{router.base_url}/version").json()
    assert version == httpx.get(f"{workers[0].base_url}/version").json()
    # Whichever worker answers, the list is the same: `created` is the router's start.
    listings = [httpx.get(f"{router.base_url}/v1/models").json() for _ in range(4)]
    assert all(listing == listings[0] for listing in listings)
    [card] = listings[0]["data"]
    assert card["id"] == card["root"] == "tiny" and card["owned_by"] == "phasefleet"
    assert card["max_model_len"] == 2048


def referenced(document: dict[str, Any], roots: list[Any]) -> dict[str, Any]:
    """The component schemas `roots` refer to, directly or through other components."""
    schemas = document.get("components", {}).get("schemas", {})
    found: dict[str, Any] = {}
    pending = list(roots)
    while pending:
        text = json.dumps(pending.pop())
        for name in re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', text):
            if name not in found:
                found[name] = schemas.get(name)
                pending.append(found[name])
    return found


def test_openapi_declares_the_workers_request_bodies(
    router: Router, workers: tuple[Worker, Worker]
) -> None:
    mine = httpx.get(f"{router.base_url}/openapi.json").json()
    theirs = httpx.get(f"{workers[0].base_url}/openapi.json").json()
    paths = (
        "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize",
        "/detokenize",
    )  # fmt: skip
    bodies = [theirs["paths"][path]["post"]["requestBody"] for path in paths]
    assert [mine["paths"][path]["post"].get("requestBody") for path in paths] == bodies
    assert bodies[0]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"
    }
    assert referenced(mine, bodies) == referenced(theirs, bodies)  # nested schemas too


def test_refused_fields_get_the_workers_400_through_the_router(via_router: openai.OpenAI) -> None:
    refused: list[tuple[dict[str, Any], str]] = [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    ]
    for fields, param in refused:
        with pytest.raises(openai.BadRequestError) as bad:
            via_router.completions.create(model="tiny", prompt=PROMPT, **fields)
        assert bad.value.param == param
