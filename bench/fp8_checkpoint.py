"""FP8 checkpoints of SmolLM2-135M-Instruct against the model itself, same process: the folder
written in compressed-tensors' format (a scale per row, W8A8 with dynamic activations) and in
the fine-grained `fp8` one (a scale per 128 x 128 block), by the tests' quantizer
(tests/engine/test_fp8.py). For each: the checkpoint's size, the loader's time (best of 3; the
FP8 ones dequantize every weight) and the greedy chat answers beside the unquantized model's.

    PYTHONPATH=. .venv/bin/python bench/fp8_checkpoint.py
"""

from __future__ import annotations

import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

import tests.engine.test_fp8 as fp8_test
from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.models.loader import load_model
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.server.named_models import named_model_folder

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


def load_seconds(folder: Path) -> float:
    config = AutoConfig.from_pretrained(folder)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        load_model(folder, config, torch.float32, torch.device("cpu"), 2048)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    base = named_model_folder("smollm2")
    if base is None:
        raise SystemExit("smollm2 is not available")
    out = Path(tempfile.mkdtemp(prefix="fp8-bench-"))
    fp8_test.BLOCK = (128, 128)
    folders = {
        "unquantized": base,
        "compressed-tensors, per row, W8A8": fp8_test.fp8_copy(
            base, out / "ct", "channel", activations=True
        ),
        "fp8, 128x128 blocks": fp8_test.fp8_copy(base, out / "fp8", "block", fmt="fp8"),
    }
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]
    print(
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    answers: dict[str, list[list[int]]] = {}
    base_load = load_seconds(base)
    for name, folder in folders.items():
        size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**20
        seconds = load_seconds(Path(folder))
        engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=256))
        params = SamplingParams(max_tokens=40, temperature=0)
        answers[name] = [r.output_token_ids for r in engine.generate(prompts, params)]
        print(
            f"\n{name}: {size:.0f} MiB of safetensors, weights loaded in {seconds:.2f} s "
            f"({seconds / base_load:.1f}x the unquantized)"
        )
        for tokens in answers[name]:
            print(f"  {tokenizer.decode(tokens, skip_special_tokens=True)!r}")
    for name in list(folders)[1:]:
        same = sum(a == b for a, b in zip(answers[name], answers["unquantized"], strict=True))
        print(
            f"{name}: {same} of {len(QUESTIONS)} answers the unquantized model's, token for token"
        )
    shutil.rmtree(out)


if __name__ == "__main__":
    main()
