"""KV handed to the engine thread as it arrives (AsyncEngine.import_kv, end_import): a chunk
that is not the next one is refused, the request waits for the end of its import (which brings
the first token), then goes on from what came, with that first token or one of its own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from phasefleet.engine.kv_transfer import KVChunk
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.server.async_engine import AsyncEngine, EngineOptions, RequestFailedError
from tests.engine.factories import engine_config, random_prompts

BLOCK = 4


def make_engine(model: Path) -> LLMEngine:
    return LLMEngine(engine_config(model, num_kv_blocks=64, block_size=BLOCK))


def finish(engine: LLMEngine) -> list[int]:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.output_token_ids
    raise AssertionError("no request finished")


def alone(model: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    """The output of `prompt` on one engine that computes it all."""
    reference = make_engine(model)
    reference.add_request("r", prompt, params)
    return finish(reference)


def prefilled(model: Path, prompt: list[int], params: SamplingParams) -> tuple[int, LLMEngine]:
    """The first token of `prompt` and the prefill engine holding its KV under a lease."""
    prefill = make_engine(model)
    prefill.add_request("p", prompt, params, prefill_only=True)
    return finish(prefill)[0], prefill


def chunk_of(prefill: LLMEngine, block: int) -> KVChunk:
    lease = prefill.pin_kv("p")
    assert lease is not None
    try:
        payload = b"".join(bytes(p) for p in prefill.runner.read_kv(lease.block_ids[block:][:1]))
    finally:
        prefill.unpin_kv(lease)
    return KVChunk(block, 1, torch.frombuffer(bytearray(payload), dtype=torch.uint8))


async def decode(
    model: Path, prompt: list[int], params: SamplingParams, feed: list[KVChunk], first: int | None
) -> tuple[list[int], int]:
    """Output and prompt tokens computed of a request queued before its first token, fed
    `feed` chunk by chunk, then ended with `first` (None: the first token never came)."""
    engine = AsyncEngine(lambda: make_engine(model), max_queue_len=4)
    engine.start(asyncio.get_running_loop())
    try:
        while not engine.ready:
            await asyncio.sleep(0.05)
        options = EngineOptions(importing_from=0)
        stream = engine.submit(["d-0"], [prompt], [params], time.monotonic(), [options])
        await stream.accepted
        for piece in feed:
            engine.import_kv("d-0", piece)
        await asyncio.sleep(0.2)  # steps run meanwhile: nothing may be computed yet
        stats = engine.stats()
        assert stats is not None and stats.prompt_tokens_total == 0
        assert stats.generation_tokens_total == 0
        engine.end_import("d-0", first)
        tokens = [event.output.output_token_ids async for event in stream][-1]
        engine.end_import("d-0", first)  # once more, later: nothing happens
        stats = engine.stats()
        assert stats is not None
        return tokens, stats.prompt_tokens_total
    finally:
        engine.stop()


def test_queued_before_its_first_token_it_goes_on_from_the_token_given_at_the_end(
    tiny_model: Path,
) -> None:
    (prompt,) = random_prompts([13], seed=21)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = alone(tiny_model, prompt, greedy)
    first, prefill = prefilled(tiny_model, prompt, greedy)
    feed = [chunk_of(prefill, b) for b in (0, 2, 1, 2, 3)]  # block 2 early: refused
    tokens, recomputed = asyncio.run(decode(tiny_model, prompt, greedy, feed, first))
    assert tokens == expected
    assert recomputed == 0  # every block came


def test_a_first_token_that_never_came_is_sampled_here_after_what_arrived(
    tiny_model: Path,
) -> None:
    (prompt,) = random_prompts([13], seed=22)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = alone(tiny_model, prompt, greedy)
    _, prefill = prefilled(tiny_model, prompt, greedy)
    feed = [chunk_of(prefill, 0), chunk_of(prefill, 1)]  # the prefill worker died after these
    tokens, recomputed = asyncio.run(decode(tiny_model, prompt, greedy, feed, None))
    assert tokens == expected
    assert recomputed == 13 - 2 * BLOCK


def test_a_whole_prompt_imported_without_its_first_token_recomputes_one_token(
    tiny_model: Path,
) -> None:
    (prompt,) = random_prompts([12], seed=23)  # three whole blocks
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    expected = alone(tiny_model, prompt, greedy)
    _, prefill = prefilled(tiny_model, prompt, greedy)
    feed = [chunk_of(prefill, b) for b in range(3)]
    tokens, recomputed = asyncio.run(decode(tiny_model, prompt, greedy, feed, None))
    assert tokens == expected
    assert recomputed == 0  # the last prompt token is run again for its logits, not counted


def test_a_first_token_out_of_the_vocabulary_fails_the_request_and_frees_it(
    tiny_model: Path,
) -> None:
    (prompt,) = random_prompts([9], seed=24)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def bad_end() -> tuple[str, int]:
        engine = AsyncEngine(lambda: make_engine(tiny_model), max_queue_len=4)
        engine.start(asyncio.get_running_loop())
        try:
            while not engine.ready:
                await asyncio.sleep(0.05)
            options = EngineOptions(importing_from=0)
            stream = engine.submit(["d-0"], [prompt], [greedy], time.monotonic(), [options])
            await stream.accepted
            engine.end_import("d-0", 10**9)
            with pytest.raises(RequestFailedError) as caught:
                async for _ in stream:
                    pass
            await asyncio.sleep(0.1)
            stats = engine.stats()
            assert stats is not None
            return str(caught.value), stats.num_running + stats.num_waiting
        finally:
            engine.stop()

    error, left = asyncio.run(bad_end())
    assert "the prefill worker's first token: first_token_id must be in" in error
    assert left == 0
