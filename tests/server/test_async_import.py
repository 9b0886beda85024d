"""KV handed to the engine thread as it arrives (AsyncEngine.import_kv): a chunk that is not the
next one ends the import, and the request goes on from what came before it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from phasefleet.engine.kv_transfer import KVChunk
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.server.async_engine import AsyncEngine, EngineOptions
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


def test_a_chunk_out_of_order_ends_the_import_and_the_rest_is_recomputed(
    tiny_model: Path,
) -> None:
    (prompt,) = random_prompts([13], seed=21)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = make_engine(tiny_model)
    reference.add_request("r", prompt, greedy)
    expected = finish(reference)
    prefill = make_engine(tiny_model)
    prefill.add_request("p", prompt, greedy, prefill_only=True)
    first = finish(prefill)[0]
    lease = prefill.pin_kv("p")
    assert lease is not None

    def chunk(block: int) -> KVChunk:
        payload = b"".join(bytes(p) for p in prefill.runner.read_kv(lease.block_ids[block:][:1]))
        return KVChunk(block, 1, torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    async def decode() -> tuple[list[int], int]:
        engine = AsyncEngine(lambda: make_engine(tiny_model), max_queue_len=4)
        engine.start(asyncio.get_running_loop())
        try:
            while not engine.ready:
                await asyncio.sleep(0.05)
            options = EngineOptions(first_token_id=first, imported_kv=[chunk(0)], importing_from=0)
            stream = engine.submit(["d-0"], [prompt], [greedy], time.monotonic(), [options])
            await stream.accepted
            engine.import_kv("d-0", chunk(2))  # block 1 is next: refused, the import ends
            tokens = [event.output.output_token_ids async for event in stream][-1]
            engine.import_kv("d-0", None)  # the stream's own end, later: nothing happens
            stats = engine.stats()
            assert stats is not None
            return tokens, stats.prompt_tokens_total
        finally:
            engine.stop()

    tokens, recomputed = asyncio.run(decode())
    assert tokens == expected
    assert recomputed == 13 - BLOCK  # block 0 came; the rest was computed here
