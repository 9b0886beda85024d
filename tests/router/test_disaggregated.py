"""Disaggregated serving through the router, over real processes and HTTP: the router names a
prefill worker, the decode worker pulls the prompt's KV from it, and the client sees exactly
what a single aggregated worker would have answered."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from phasefleet.api.contract import INTERNAL_TOKEN_ENV
from tests.router.router_proc import Router, run_router
from tests.server.worker_proc import Worker, run_worker

TOKEN = "router-test-token"
WORKER_ARGS = ("--num-kv-blocks", "256", "--remote-prefill-min-tokens", "0", "--block-size", "16")
# Prompts of many lengths: inside one block, at boundaries, across several blocks.
PROMPTS = [f"Prompt {i}: " + "the tide comes in and goes out again " * (i % 5) for i in range(20)]


@dataclass
class Fleet:
    router: Router
    prefill: Worker
    decode: Worker
    reference: Worker  # an aggregated worker, outside the fleet
    members: Path  # the router's workers file


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    members = tmp_path_factory.mktemp("fleet") / "workers.json"
    mp = pytest.MonkeyPatch()
    mp.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    try:
        with (
            run_worker(tiny_model, "--role", "prefill", *WORKER_ARGS) as prefill,
            run_worker(tiny_model, "--role", "decode", *WORKER_ARGS) as decode,
            run_worker(tiny_model, "--num-kv-blocks", "256") as reference,
        ):
            members.write_text(
                json.dumps({"prefill": [prefill.base_url], "decode": [decode.base_url]})
            )
            args = ("--workers-file", str(members), "--refresh-interval", "0.5")
            with run_router(*args, "--policy", "prefix-aware") as router:
                yield Fleet(router, prefill, decode, reference, members)
    finally:
        mp.undo()


def complete(client: openai.OpenAI, prompt: str, stream: bool, max_tokens: int = 10) -> str:
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        return client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    chunks = client.completions.create(stream=True, **kw)  # type: ignore[call-overload]
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_router_output_equals_an_aggregated_worker(fleet: Fleet, stream: bool) -> None:
    remote = fleet.decode.counter("phasefleet_prefills_total", where="remote")
    for prompt in PROMPTS[:6] + PROMPTS[:2]:  # the repeats hit both workers' prefix caches
        got = complete(fleet.router.client(), prompt, stream)
        assert got == complete(fleet.reference.client(), prompt, stream), prompt
    assert fleet.decode.counter("phasefleet_prefills_total", where="remote") > remote
    assert fleet.decode.counter("phasefleet_kv_transfer_bytes_total") > 0
    assert fleet.decode.counter("phasefleet_kv_transfer_failures_total") == 0
    assert fleet.prefill.counter("phasefleet_prompt_tokens_total") > 0


def test_chat_through_the_router_equals_an_aggregated_worker(fleet: Fleet) -> None:
    answers = []
    for client in (fleet.router.client(), fleet.reference.client()):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Say something about the harbour at dawn"}],
            max_tokens=12,
            temperature=0,
        )
        answers.append((out.choices[0].message.content, out.usage))
    assert answers[0] == answers[1]


def test_two_hundred_concurrent_streams_are_each_their_own(fleet: Fleet) -> None:
    expected = {
        p: complete(fleet.reference.client(), p, stream=False, max_tokens=8) for p in PROMPTS
    }

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        chunks = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"{fleet.router.base_url}/v1", api_key="unused", max_retries=0, timeout=300
        )
        try:
            return await asyncio.gather(*(one(client, PROMPTS[i % 20]) for i in range(200)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert [r == expected[PROMPTS[i % 20]] for i, r in enumerate(results)] == [True] * 200


def test_a_prefill_worker_that_dies_costs_no_request(fleet: Fleet, tiny_model: Path) -> None:
    """Whether the router still names the dead worker (then the decode worker cannot reach it)
    or has already dropped it, the decode worker prefills the prompt itself."""
    with run_worker(tiny_model, "--role", "prefill", *WORKER_ARGS) as doomed:
        fleet.members.write_text(
            json.dumps({"prefill": [doomed.base_url], "decode": [fleet.decode.base_url]})
        )
        try:
            time.sleep(1.5)  # the router has read the new membership
            doomed.proc.send_signal(signal.SIGKILL)
            doomed.proc.wait(timeout=10)
            local = fleet.decode.counter("phasefleet_prefills_total", where="local")
            remote = fleet.decode.counter("phasefleet_prefills_total", where="remote")
            prompt = PROMPTS[7]
            got = complete(fleet.router.client(), prompt, stream=True)
            assert got == complete(fleet.reference.client(), prompt, stream=True)
            assert fleet.decode.counter("phasefleet_prefills_total", where="local") == local + 1
            assert fleet.decode.counter("phasefleet_prefills_total", where="remote") == remote
        finally:
            fleet.members.write_text(
                json.dumps({"prefill": [fleet.prefill.base_url], "decode": [fleet.decode.base_url]})
            )
