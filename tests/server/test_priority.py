"""Priority scheduling on a real worker (`--scheduling-policy priority`, one sequence at a
time): requests queued behind a running one are served by their `priority`, lower first, not by
arrival; the hand-off carries the priority to the prefill worker."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from phasefleet.api.contract import Metric
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.server.kv_wire import PrefillRequest
from tests.server.worker_proc import Worker, parse_metrics, run_worker


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[Worker]:
    args = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
    with run_worker(tiny_model, *args) as w:
        yield w


def test_queued_requests_are_served_by_priority(worker: Worker) -> None:
    async def run() -> list[str]:
        # no retries: a timed-out request retried would arrive again, later, out of its order
        client = openai.AsyncOpenAI(
            base_url=f"{worker.base_url}/v1", api_key="x", timeout=300, max_retries=0
        )
        # by the first token's arrival, the embedding's by its answer: one sequence at a time,
        # each starts only after the one before has sent all its 24 tokens, so a client
        # stalled by a busy machine cannot see two of them out of their order (the embedding,
        # with no tokens to wait for, is served last)
        done: list[str] = []
        kw = {"model": "tiny", "prompt": "The sea", "temperature": 0, "max_tokens": 24}

        async def one(name: str, priority: int) -> None:
            stream = await client.completions.create(
                **kw, stream=True, extra_body={"priority": priority, "ignore_eos": True}
            )  # type: ignore[call-overload]
            await anext(stream)
            done.append(name)
            async for _ in stream:
                pass

        async def embed(name: str, priority: int) -> None:
            await client.embeddings.create(
                model="tiny", input="The sea", extra_body={"priority": priority}
            )
            done.append(name)

        long = await client.completions.create(
            model="tiny", prompt="A long one", max_tokens=1500, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        await anext(long)  # running: every request after it waits
        queued = [asyncio.create_task(embed("embedding", 9))]
        await asyncio.sleep(0.05)
        for name, priority in [("batch", 5), ("normal", 0), ("urgent", -2)]:
            queued.append(asyncio.create_task(one(name, priority)))
            await asyncio.sleep(0.05)  # arrival order: embedding, batch, normal, urgent
        await _until_waiting(worker, 4)  # all queued in the engine, behind the long one
        async for _ in long:
            pass
        await asyncio.gather(*queued)
        await client.close()
        return done

    assert asyncio.run(run()) == ["urgent", "normal", "batch", "embedding"]


async def _until_waiting(worker: Worker, n: int, timeout: float = 60.0) -> None:
    """Until the worker's engine holds n waiting requests (a loaded machine may take a while to
    bring them in; the test's order is the engine's, not the network's)."""
    name = f"{Metric.NUM_REQUESTS_WAITING}{{"
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(int(timeout / 0.05)):
            text = (await http.get(f"{worker.base_url}/metrics")).text
            waiting = [float(v) for k, v in parse_metrics(text).items() if k.startswith(name)]
            if waiting and waiting[0] >= n:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{n} requests never waited together in the engine")


def test_the_hand_off_carries_the_priority() -> None:
    sent = PrefillRequest.of("r", [1, 2], SamplingParams(max_tokens=2), priority=-7)
    assert PrefillRequest.model_validate_json(sent.model_dump_json()).priority == -7
    assert PrefillRequest.of("r", [1, 2], SamplingParams(max_tokens=2)).priority == 0


def test_a_priority_out_of_range_is_a_400(worker: Worker) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        worker.client().completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"priority": 2**40}
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "priority"
