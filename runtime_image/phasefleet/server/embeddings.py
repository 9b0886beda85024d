"""POST /v1/embeddings: one vector per input (a text, token ids, or a list of either), the last
token's final hidden state, L2-normalized, as Qwen3-Embedding, gte-Qwen2 and e5-mistral pool
and as vLLM's embedding runner does for a causal model. Any model the worker serves answers; a
sentence-transformers folder says how it pools (server/pooling.py); one that pools otherwise
(mean, CLS) or projects after pooling (Dense) is refused by name.

Each input is an engine request that computes its prompt (prefix-cache hits included) and
samples nothing (LLMEngine.add_embedding_request)."""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.server.async_engine import EngineOptions
from phasefleet.server.completions import num_prompts, prompts_of
from phasefleet.server.errors import bad_request
from phasefleet.server.generation import Generation, check_queue_room, truncated
from phasefleet.server.openai_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from phasefleet.server.responses import collect_or_abort
from phasefleet.server.state import WorkerState

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
UNUSED = SamplingParams(max_tokens=1)  # an embedding request samples nothing


def shaped(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """vector: [hidden] float32 -> its first `dimensions` values (all: None), L2-normalized
    when `normalize`."""
    out = vector[:dimensions] if dimensions is not None else vector
    if normalize:
        out = out / max(float(np.linalg.norm(out)), 1e-12)
    return out.astype(np.float32)


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def create_embeddings(req: EmbeddingRequest, raw: Request, state: WorkerState) -> Response:
    arrival = time.monotonic()
    lora = state.check_model(req.model)
    pooling = state.pooling
    if pooling.refused is not None:
        raise bad_request(f"this model serves no embeddings: {pooling.refused}", "model")
    width = pooling.hidden_size
    if req.dimensions is not None and width is not None and req.dimensions > width:
        raise bad_request(
            f"dimensions must be <= this model's {width}, got {req.dimensions}", "dimensions"
        )
    count = num_prompts(req.input)
    if count > MAX_INPUTS:
        raise bad_request(f"input holds {count} inputs, more than {MAX_INPUTS}", "input")
    state.check_accepting()
    check_queue_room(count, 1, state.engine.max_queue_len, "input")
    prompts = await state.off_loop(prompts_of, req.input, state, "input")
    max_len = state.engine.max_model_len
    prompts = [truncated(p, req.truncate_prompt_tokens, max_len) for p in prompts]
    for i, prompt in enumerate(prompts):
        if len(prompt) > max_len:
            raise bad_request(
                f"input {i} has {len(prompt)} tokens, more than this model's maximum context "
                f"length ({max_len}); shorten it or set truncate_prompt_tokens",
                "input",
            )
    gen = Generation(
        state.engine,
        state.metrics,
        prompts,
        [UNUSED] * len(prompts),
        arrival,
        "input",
        options=[EngineOptions(embed=True) for _ in prompts],
        late_after_s=state.late_after_s(raw.headers),
        priority=state.check_priority(req.priority),
        lora=lora,
    )
    await gen.start()
    finals = await collect_or_abort(gen, raw)
    normalize = pooling.normalize if req.normalize is None else req.normalize
    data = []
    for i, out in enumerate(finals):
        if out.embedding is None:
            raise RuntimeError(f"embedding request {out.request_id} finished without one")
        vector = shaped(out.embedding, req.dimensions, normalize)
        data.append(EmbeddingData(embedding=encoded(vector, req.encoding_format), index=i))
    tokens = sum(len(p) for p in prompts)
    body = EmbeddingResponse(
        data=data, model=req.model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )
    return Response(body.model_dump_json(), media_type="application/json")
