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
from typing import Any

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
            args = (
                "--workers-file", str(members), "--refresh-interval", "0.5",
                "--late-after-ms", "1",  # a TTFT target for late prompts last, per request
            )  # fmt: skip
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


def test_embeddings_go_to_the_prefill_worker(fleet: Fleet) -> None:
    """An embedding is a prompt alone: the router sends it to a prefill worker, no hand-off;
    the vectors are the aggregated worker's."""
    texts = [f"embed {i}: the harbour at dawn" for i in range(4)]
    decode_tokens = fleet.decode.counter("phasefleet_prompt_tokens_total")
    prefill_tokens = fleet.prefill.counter("phasefleet_prompt_tokens_total")
    got = fleet.router.client().embeddings.create(model="tiny", input=texts)
    want = fleet.reference.client().embeddings.create(model="tiny", input=texts)
    for mine, theirs in zip(got.data, want.data, strict=True):
        assert mine.embedding == pytest.approx(theirs.embedding, abs=1e-6)
    assert fleet.prefill.counter("phasefleet_prompt_tokens_total") >= prefill_tokens + 4 * 5
    assert fleet.decode.counter("phasefleet_prompt_tokens_total") == decode_tokens


def test_a_seeded_sample_through_the_hand_off_equals_one_worker(fleet: Fleet) -> None:
    """The first token is drawn on the prefill worker, the rest on the decode worker: a seeded
    draw depends on the seed, the token's position and the logits only."""

    def sampled(client: openai.OpenAI, seed: int) -> list[str]:
        kw = {"model": "tiny", "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": seed}
        return [
            client.completions.create(prompt=p, **kw).choices[0].text  # type: ignore[call-overload]
            for p in PROMPTS[:3]
        ]

    remote = fleet.decode.counter("phasefleet_prefills_total", where="remote")
    through_router = sampled(fleet.router.client(), 11)
    assert fleet.decode.counter("phasefleet_prefills_total", where="remote") >= remote + 3
    assert through_router == sampled(fleet.reference.client(), 11)
    assert sampled(fleet.router.client(), 12) != through_router  # another seed, other tokens


def stream_all(fleet: Fleet, prompts: list[str]) -> list[str]:
    """Every prompt streamed through the router at once (8 tokens, greedy); their texts."""

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
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    return asyncio.run(run_all())


def test_two_hundred_concurrent_streams_are_each_their_own(fleet: Fleet) -> None:
    expected = {
        p: complete(fleet.reference.client(), p, stream=False, max_tokens=8) for p in PROMPTS
    }
    results = stream_all(fleet, [PROMPTS[i % 20] for i in range(200)])
    assert [r == expected[PROMPTS[i % 20]] for i, r in enumerate(results)] == [True] * 200


def test_the_routers_ttft_target_reaches_the_prefill_worker(fleet: Fleet) -> None:
    """The router sends its --late-after-ms with each request and the decode worker passes it
    on with the hand-off: the prefill worker, started without the flag, serves the prompts
    that waited past 1 ms after fresher ones, and every answer is still whole and the same."""
    late = "phasefleet_late_prompts_total"
    before = fleet.prefill.counter(late)
    prompts = [f"Late {i}: " + "the tide comes in and goes out again " * 4 for i in range(40)]
    expected = [complete(fleet.reference.client(), p, stream=False, max_tokens=8) for p in prompts]
    assert stream_all(fleet, prompts) == expected
    assert fleet.prefill.counter(late) > before
    assert fleet.reference.counter(late) == 0  # no router, no target: first come, first served


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
            time.sleep(1.5)  # the next test's router names the live prefill worker again


def test_logprobs_and_min_tokens_cross_the_hand_off_and_echo_prefills_on_the_decode_worker(
    fleet: Fleet,
) -> None:
    def logprobs(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[list[str], list[Any]]:
        if not stream:
            lp = client.completions.create(**kw).choices[0].logprobs
            assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
            return lp.tokens, lp.token_logprobs
        chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)]
        tokens = [t for lp in chunks if lp for t in lp.tokens or []]
        return tokens, [v for lp in chunks if lp for v in lp.token_logprobs or []]

    def prefills(where: str) -> float:
        return fleet.decode.counter("phasefleet_prefills_total", where=where)

    routed, reference = fleet.router.client(), fleet.reference.client()
    kw: dict[str, Any] = {
        "model": "tiny", "prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0, "logprobs": 2
    }  # fmt: skip
    remote, local = prefills("remote"), prefills("local")
    for stream in (False, True):
        got, want = logprobs(routed, stream, **kw), logprobs(reference, stream, **kw)
        assert got[0] == want[0] and len(got[0]) == 6
        # The first token's logprob came from the prefill worker, the rest from the decode one.
        assert got[1] == pytest.approx(want[1], abs=1e-4)
    assert (prefills("remote"), prefills("local")) == (remote + 2, local)

    got, want = (
        logprobs(routed, False, echo=True, **kw),
        logprobs(reference, False, echo=True, **kw),
    )
    assert got[0] == want[0] and got[1][0] is None
    assert got[1] == pytest.approx(want[1], abs=1e-4)
    assert (prefills("remote"), prefills("local")) == (remote + 2, local + 1)

    # min_tokens reaches the prefill worker: the first token may not be a stop token.
    ids: dict[str, Any] = {"return_token_ids": True}
    first = routed.completions.create(**kw, extra_body=ids).choices[0]
    stop = {**ids, "stop_token_ids": [extra_ids(first)[0]], "min_tokens": 3}
    held = [c.completions.create(**kw, extra_body=stop).choices[0] for c in (routed, reference)]
    assert extra_ids(held[0]) == extra_ids(held[1])
    assert len(extra_ids(held[0])) >= 3 and extra_ids(held[0])[0] != extra_ids(first)[0]


def extra_ids(choice: Any) -> list[int]:
    return list((choice.model_extra or {})["token_ids"])
