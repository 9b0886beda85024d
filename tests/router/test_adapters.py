"""The router's runtime LoRA adapters: one load or unload sent to every worker, what comes back
when some refuse, and loading onto workers that join. The workers are faked at the HTTP
boundary (httpx's MockTransport); tests/router/test_lora_routing.py runs real ones."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from phasefleet.router.adapters import RETRY_S, FleetAdapters
from phasefleet.router.pool import WorkerState
from phasefleet.router.upstream import Upstream, parse_metrics
from phasefleet.server.openai_protocol import LoadLoraAdapter, UnloadLoraAdapter

A, B, C = "http://a:1", "http://b:1", "http://c:1"
SQL = LoadLoraAdapter(lora_name="sql", lora_path="/adapters/sql")
UNLOAD_SQL = UnloadLoraAdapter(lora_name="sql")
CLIENT = {"authorization": "Bearer client-key"}  # the client's header, passed on
OWN = {"authorization": "Bearer router-key"}  # the router's first key, for its own loads

Handler = Callable[[str, str, dict[str, str]], httpx.Response]


def error(status: int, message: str, code: str | None = None) -> httpx.Response:
    body = {"error": {"message": message, "type": "x", "param": None, "code": code}}
    return httpx.Response(status, json=body)


def ok(url: str, path: str, body: dict[str, str]) -> httpx.Response:
    return httpx.Response(200, text="Success")


class FakeWorkers:
    """Every request the router sends, as (worker url, path, body); answers from `handler`."""

    def __init__(self, handler: Handler = ok) -> None:
        self.handler = handler
        self.sent: list[tuple[str, str, dict[str, str]]] = []
        self.authorization: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content)
        self.sent.append((url, request.url.path, body))
        self.authorization.append(request.headers.get("authorization"))
        return self.handler(url, request.url.path, body)


def fleet(workers: FakeWorkers) -> FleetAdapters:
    upstream = Upstream()
    upstream.client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
    return FleetAdapters(upstream, OWN)


def states(*urls: str) -> list[WorkerState]:
    return [WorkerState(url, healthy=True) for url in urls]


def text(response: object) -> str:
    return bytes(response.body).decode()  # type: ignore[attr-defined]


def test_a_load_goes_to_every_worker_and_is_remembered() -> None:
    workers = FakeWorkers()
    adapters, ready = fleet(workers), states(A, B)
    answer = asyncio.run(adapters.load(SQL, ready, CLIENT))
    assert answer.status_code == 200
    assert "added on 2 of 2 workers" in text(answer)
    sent = {(url, path) for url, path, _ in workers.sent}
    assert sent == {(A, "/v1/load_lora_adapter"), (B, "/v1/load_lora_adapter")}
    assert workers.sent[0][2] == {"lora_name": "sql", "lora_path": "/adapters/sql"}
    assert workers.authorization == ["Bearer client-key"] * 2
    assert adapters.sources == {"sql": "/adapters/sql"}
    assert all(s.adapters == {"sql"} for s in ready)  # routed to at once, before a poll


def test_a_load_some_workers_refuse_names_them_and_still_serves() -> None:
    def handler(url: str, path: str, body: dict[str, str]) -> httpx.Response:
        return error(400, "no free LoRA slot") if url == B else ok(url, path, body)

    adapters, ready = fleet(FakeWorkers(handler)), states(A, B)
    answer = asyncio.run(adapters.load(SQL, ready, CLIENT))
    assert answer.status_code == 200
    assert "added on 1 of 2 workers" in text(answer)
    assert f"not on {B}: 400 no free LoRA slot" in text(answer)
    assert [s.adapters for s in ready] == [{"sql"}, set()]
    assert "sql" in adapters.sources  # B is tried again later (reconcile)


def test_a_load_every_worker_refuses_is_their_answer_and_forgotten() -> None:
    message = "lora_path: /adapters/sql is not a folder"

    def handler(url: str, path: str, body: dict[str, str]) -> httpx.Response:
        return error(400, message)

    adapters = fleet(FakeWorkers(handler))
    answer = asyncio.run(adapters.load(SQL, states(A, B), CLIENT))
    assert answer.status_code == 400
    assert json.loads(text(answer))["error"]["message"] == message
    assert adapters.sources == {}


def test_a_load_already_everywhere_is_the_workers_400() -> None:
    def handler(url: str, path: str, body: dict[str, str]) -> httpx.Response:
        return error(400, "LoRA adapter 'sql' is already loaded", "lora_already_loaded")

    adapters = fleet(FakeWorkers(handler))
    answer = asyncio.run(adapters.load(SQL, states(A, B), CLIENT))
    assert answer.status_code == 400
    assert json.loads(text(answer))["error"]["code"] == "lora_already_loaded"


def test_a_load_already_on_some_completes_the_fleet() -> None:
    def handler(url: str, path: str, body: dict[str, str]) -> httpx.Response:
        if url == A:
            return error(400, "LoRA adapter 'sql' is already loaded", "lora_already_loaded")
        return ok(url, path, body)

    adapters, ready = fleet(FakeWorkers(handler)), states(A, B)
    answer = asyncio.run(adapters.load(SQL, ready, CLIENT))
    assert answer.status_code == 200 and "added on 2 of 2 workers" in text(answer)
    assert all(s.adapters == {"sql"} for s in ready)


def test_unreachable_workers_are_a_502_and_no_worker_a_503() -> None:
    def handler(url: str, path: str, body: dict[str, str]) -> httpx.Response:
        raise httpx.ConnectError("refused")

    adapters = fleet(FakeWorkers(handler))
    answer = asyncio.run(adapters.load(SQL, states(A), CLIENT))
    assert answer.status_code == 502 and "unreachable" in text(answer)
    answer = asyncio.run(adapters.load(SQL, [], CLIENT))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"


def test_an_unload_in_use_somewhere_is_a_409_and_never_loaded_again() -> None:
    def handler(url: str, path: str, body: dict[str, str]) -> httpx.Response:
        if path == "/v1/unload_lora_adapter" and url == B:
            return error(409, "LoRA adapter 'sql' has running requests", "lora_in_use")
        return ok(url, path, body)

    workers = FakeWorkers(handler)
    adapters, ready = fleet(workers), states(A, B)
    asyncio.run(adapters.load(SQL, ready, CLIENT))
    answer = asyncio.run(adapters.unload(UNLOAD_SQL, ready, CLIENT))
    assert answer.status_code == 409
    assert json.loads(text(answer))["error"]["code"] == "lora_in_use"
    assert "removed from 1 workers" in text(answer) and B in text(answer)
    assert adapters.sources == {}
    assert [s.adapters for s in ready] == [set(), {"sql"}]
    workers.sent.clear()
    ready[0].adapters = frozenset()
    adapters.reconcile(ready, now=0.0)
    assert workers.sent == []  # forgotten: a worker without it is not given it back


def test_an_unload_counts_workers_without_the_adapter_as_done() -> None:
    def handler(url: str, path: str, body: dict[str, str]) -> httpx.Response:
        if path == "/v1/unload_lora_adapter" and url == B:
            return error(404, "LoRA adapter 'sql' is not loaded", "not_found")
        return ok(url, path, body)

    adapters = fleet(FakeWorkers(handler))
    answer = asyncio.run(adapters.unload(UNLOAD_SQL, states(A, B), CLIENT))
    assert answer.status_code == 200 and "removed from 1 workers" in text(answer)

    def nowhere(url: str, path: str, body: dict[str, str]) -> httpx.Response:
        return error(404, "LoRA adapter 'sql' is not loaded", "not_found")

    adapters = fleet(FakeWorkers(nowhere))
    answer = asyncio.run(adapters.unload(UNLOAD_SQL, states(A, B), CLIENT))
    assert answer.status_code == 404 and "not loaded on any worker" in text(answer)


def test_a_joining_worker_gets_the_remembered_adapters_once() -> None:
    workers = FakeWorkers()
    adapters = fleet(workers)

    async def scenario() -> None:
        await adapters.load(SQL, states(A), CLIENT)
        joined = states(A, C)
        joined[0].adapters = frozenset({"sql"})
        workers.sent.clear()
        adapters.reconcile(joined, now=0.0)
        adapters.reconcile(joined, now=0.5)  # the load is still running: not sent twice
        await asyncio.sleep(0.05)
        assert [(url, path) for url, path, _ in workers.sent] == [(C, "/v1/load_lora_adapter")]
        assert workers.authorization[-1] == "Bearer router-key"
        assert joined[1].adapters == {"sql"}

    asyncio.run(scenario())


def test_a_failed_load_onto_a_joining_worker_waits_before_the_next_try() -> None:
    answers = iter([error(400, "no free LoRA slot"), httpx.Response(200, text="Success")])
    workers = FakeWorkers(lambda url, path, body: next(answers))
    adapters = fleet(workers)
    adapters.sources["sql"] = "/adapters/sql"
    joined = states(C)

    async def settle() -> None:
        await asyncio.sleep(0.05)

    async def scenario() -> None:
        adapters.reconcile(joined, now=100.0)
        await settle()
        adapters.reconcile(joined, now=100.0 + RETRY_S - 1)
        await settle()
        assert len(workers.sent) == 1 and joined[0].adapters == frozenset()
        adapters.reconcile(joined, now=100.0 + RETRY_S)
        await settle()
        assert len(workers.sent) == 2 and joined[0].adapters == {"sql"}

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ('phasefleet_lora_adapter_loaded{lora_name="sql",model_name="m",role="both"} 1.0\n'
         'phasefleet_lora_adapter_loaded{lora_name="a.b:c-1",model_name="m",role="both"} 1.0',
         {"sql", "a.b:c-1"}),
        ('phasefleet_lora_requests_info{max_lora="2",running_lora_adapters="sql"} 1.0', set()),
        ("", set()),
    ],
)  # fmt: skip
def test_a_workers_metrics_say_which_adapters_it_has(text: str, found: set[str]) -> None:
    assert parse_metrics(text)[1] == found
