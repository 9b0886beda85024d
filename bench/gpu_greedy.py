"""Greedy output in bfloat16 against transformers in bfloat16, on the same device and weights.

In bfloat16 two correct implementations may part after some tokens (a near tie decided by
rounding), and after that they write different texts. So each prompt records where it first
diverges, and the check fails only when most prompts diverge within their first few tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gpu_models import smollm2, tiny
from gpu_report import CheckContext, Status

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import SamplingParams

EARLY = 4  # a prompt diverging before this many tokens counts against the check
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "Explain in two sentences why the sky is blue.",
]


def _transformers_greedy(folder: Path, device: str, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, no KV cache: the plainest reference (as tests/engine's hf_greedy)."""
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(folder)
    if model is None:
        loaded: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        model = _hf_models[folder] = loaded.to(device).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=device)).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


_hf_models: dict[Path, Any] = {}


def compare(
    folder: Path, device: str, prompts: list[list[int]], n: int, data: dict[str, Any]
) -> tuple[Status, str]:
    eng = LLMEngine(
        EngineConfig(model=str(folder), device=device, dtype="bfloat16", num_kv_blocks=1024)
    )
    data["decode_backend"] = eng.runner.decode_backend
    data["cuda_graphs"] = eng.runner.graphs is not None
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ours = [o.output_token_ids for o in eng.generate(prompts, params)]
    first, same = [], 0
    for prompt, mine in zip(prompts, ours, strict=True):
        theirs = _transformers_greedy(folder, device, prompt, n)
        same += sum(a == b for a, b in zip(mine, theirs, strict=True))
        first.append(
            next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        )
    _hf_models.clear()
    data.update(prompt_tokens=[len(p) for p in prompts], tokens_per_prompt=n)
    data["first_divergence"] = first  # None: all n tokens agree
    data["agreement"] = same / (n * len(prompts))
    early = sum(d is not None and d < EARLY for d in first)
    summary = (
        f"{data['agreement']:.0%} of tokens agree; first divergence per prompt {first} (of {n})"
    )
    return (Status.FAILED if 2 * early > len(prompts) else Status.OK), summary


def greedy_tiny(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 17, 40, 64, 100, 250] if not ctx.quick else [3, 17, 40]
    prompts = [torch.randint(5, 500, (k,), generator=gen).tolist() for k in lengths]
    return compare(tiny(ctx), ctx.device, prompts, 32 if not ctx.quick else 12, data)


def greedy_smollm2(ctx: CheckContext, data: dict[str, Any]) -> tuple[Status, str]:
    if ctx.quick:
        return Status.NOT_APPLICABLE, "--quick runs no SmolLM2 check"
    folder = smollm2(ctx)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True
            )
        )
        for q in QUESTIONS
    ]
    return compare(folder, ctx.device, prompts, 32, data)
