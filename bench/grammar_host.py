"""Host time of structured output, for B decode rows on a real tokenizer (SmolLM2's, 49,152
tokens), as the runner spends it: before the forward, the step's sampling settings and their
share of its one upload (beside a plain batch in the same process); during the forward (on a
GPU the host computes them while the device runs it), each grammar row's mask of allowed tokens,
written by llguidance, and their own upload. Then the masks alone, computed one by one beside
in parallel (llguidance's threads, what the sampler does from PARALLEL_MASKS rows on a host of
PARALLEL_MIN_CPUS); and what compiling costs once (the tokenizer's index, a grammar, a copy of
a compiled one).

Every row follows a JSON schema of the kind extraction asks for (strings, an enum, numbers, an
array); between steps each row takes a random token its mask allows, so the rows walk through
the grammar as an answer would (a row whose grammar completes starts again). Wall time (the
parallel masks run on other threads), median and worst of --repeats steps.

    .venv/bin/python bench/grammar_host.py                 # B = 1, 16, 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import numpy as np
import torch

from phasefleet.engine.grammar import GrammarCompiler, fill_masks, mask_words
from phasefleet.engine.sampler import SamplingBatch, SamplingRow, grammar_masks
from phasefleet.engine.sampling_params import Grammar, SamplingParams
from phasefleet.engine.staging import HostStaging
from phasefleet.engine.tokenizer import load_tokenizer
from phasefleet.server.named_models import named_model_folder

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["person", "place", "thing"]},
        "year": {"type": "integer", "minimum": 0, "maximum": 3000},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "kind", "year", "score", "tags"],
    "additionalProperties": False,
}


def allowed_tokens(words: np.ndarray, vocab: int) -> np.ndarray:
    bits = (words[:, None] >> np.arange(32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab])


def take(made: list[SamplingRow], tokens: list[int], compiler: GrammarCompiler) -> None:
    """Row k takes tokens[k] (a completed grammar starts again)."""
    for row, token in zip(made, tokens, strict=True):
        assert row.matcher is not None and row.params.grammar is not None
        row.matcher.accept(token)
        if row.matcher.done:
            row.matcher = compiler.matcher(row.params.grammar)


def timings(
    made: list[SamplingRow],
    twins: list[list[SamplingRow]],
    compilers: list[GrammarCompiler],
    staging: tuple[HostStaging, HostStaging],
    repeats: int,
) -> dict[str, list[float]]:
    """Seconds per step of the sampling settings on the host, as the runner spends them:
    'inputs' (from_rows and the step's upload, before the forward) and, for grammar rows,
    'masks' (`grammar_masks` and their own upload, made while a GPU runs the forward); and two
    twin sets' masks alone, computed one by one and on llguidance's threads. Each set follows
    the same grammars with a compiler of its own (no cache shared) and takes the same tokens,
    so every mask is computed afresh."""
    vocab, rng = compilers[0].vocab_size, random.Random(0)
    out: dict[str, list[float]] = {"inputs": [], "masks": [], "one_by_one": [], "parallel": []}
    for _ in range(repeats):
        start = time.perf_counter()
        batch = SamplingBatch.from_rows(made, [100] * len(made), vocab)
        for array in batch.arrays():
            staging[0].add(array)
        staging[0].upload()
        out["inputs"].append(time.perf_counter() - start)
        if not batch.grammar:
            continue
        start = time.perf_counter()
        allowed = grammar_masks(made, vocab)
        staging[1].add(allowed)
        staging[1].upload()
        out["masks"].append(time.perf_counter() - start)
        for mode, twin in zip(("one_by_one", "parallel"), twins, strict=True):
            matchers = [row.matcher for row in twin if row.matcher is not None]
            words = np.zeros((len(matchers), mask_words(vocab)), dtype=np.int32)
            start = time.perf_counter()
            fill_masks(matchers, words, parallel=mode == "parallel")
            out[mode].append(time.perf_counter() - start)
            assert np.array_equal(allowed, words)
        tokens = [rng.choice(allowed_tokens(row, vocab).tolist()) for row in allowed]
        for rows, compiler in zip([made, *twins], compilers, strict=True):
            take(rows, tokens, compiler)
    return out


def ms(times: list[float]) -> str:
    return f"{np.median(times) * 1e3:.3f} (worst {max(times) * 1e3:.2f})"


def measure(tokenizer: Any, batches: list[int], repeats: int) -> dict[str, Any]:
    """Compile costs, then per batch size the plain and schema steps and the masks alone (one
    by one, in parallel): each a list of seconds per step."""
    vocab = len(tokenizer)
    eos = {tokenizer.eos_token_id}
    compilers = [GrammarCompiler(tokenizer, vocab, eos) for _ in range(3)]
    compiler = compilers[0]
    grammar = Grammar("json", json.dumps(SCHEMA))
    result: dict[str, Any] = {"vocab": vocab, "cpus": os.cpu_count()}
    cpu = torch.device("cpu")
    start = time.perf_counter()
    compiler.matcher(Grammar("regex", "a"))  # builds the tokenizer's index
    result["index_s"] = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(grammar)
    result["compile_ms"] = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiler.matcher(grammar)
    result["copy_ms"] = (time.perf_counter() - start) * 1e3
    staging = (HostStaging(cpu, copy=True), HostStaging(cpu, copy=True))
    for b in batches:
        plain_rows = [SamplingRow(SamplingParams(temperature=0.7, top_p=0.9)) for _ in range(b)]
        params = SamplingParams(temperature=0.7, top_p=0.9, grammar=grammar)
        rows, *twins = [
            [SamplingRow(params, matcher=c.matcher(grammar)) for _ in range(b)] for c in compilers
        ]
        ruled = timings(rows, twins, compilers, staging, repeats)
        ruled["plain"] = timings(plain_rows, [], compilers[:1], staging, repeats)["inputs"]
        result[f"B={b}"] = ruled
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--repeats", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(1)
    folder = named_model_folder("smollm2")
    assert folder is not None
    batches = [int(x) for x in args.batches.split(",")]
    result = measure(load_tokenizer(folder), batches, args.repeats)
    print(
        f"torch {torch.__version__}, vocabulary {result['vocab']}, {result['cpus']} CPUs, "
        "wall ms per step"
    )
    print(
        f"tokenizer index {result['index_s']:.2f} s, compile {result['compile_ms']:.2f} ms, "
        f"copy {result['copy_ms']:.3f} ms"
    )
    for b in batches:
        r = result[f"B={b}"]
        masks = {mode: float(np.median(r[mode])) for mode in ("one_by_one", "parallel")}
        print(
            f"B={b} before the forward: plain={ms(r['plain'])} schema={ms(r['inputs'])} | "
            f"during it: masks={ms(r['masks'])} | masks alone: "
            f"one_by_one={ms(r['one_by_one'])} parallel={ms(r['parallel'])} "
            f"one_by_one/parallel={masks['one_by_one'] / masks['parallel']:.1f}x"
        )


if __name__ == "__main__":
    main()
