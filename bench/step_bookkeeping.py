"""The engine's host work per decode step outside the model runner: scheduling, applying the
sampled tokens, detokenizing and building each request's output. On a GPU this is time the device
waits for (the step's inputs are uploaded after it, its outputs read before it), and it grows
with the batch: `bench/gpu_check.py`'s roofline check saw the H200 idle 29% of a batch-64 step.

Measured as the thread CPU time of `LLMEngine.step()` less that of `ModelRunner.execute` (the
forward, the sampler, the step's plan and upload), median of --steps decode steps, B requests
that have each produced about --out tokens. Two engines side by side, in this process:

- before: detokenizing through transformers' `tokenizer.decode` and every output carrying a copy
  of all the request's tokens so far (as the engine did until 2026-11-27);
- now: the Rust tokenizer's decode called directly (`detokenizer.decoder`), and the whole list
  only on a request's last output.

    .venv/bin/python bench/step_bookkeeping.py                    # SmolLM2's tokenizer
    .venv/bin/python bench/step_bookkeeping.py --model DIR --batches 1,64 --out 100,1000

The model runs on the CPU (a tiny random one with the --model folder's tokenizer): only the
host side is timed, and the forward's cost does not enter it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.model_runner import Executed
from phasefleet.engine.outputs import RequestOutput
from phasefleet.engine.request import Request
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.tiny import make_tiny

SMOLLM2 = Path.home() / ".cache/phasefleet/models/smollm2-0.1.2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def model_with_tokenizer(tokenizer_folder: Path | None, folder: Path) -> Path:
    """A tiny random model; with the tokenizer files of `tokenizer_folder` when given."""
    if tokenizer_folder is None:
        return make_tiny(folder)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json")).get_vocab_size()
    make_tiny(folder, vocab_size=vocab)
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).is_file():
            shutil.copy(tokenizer_folder / name, folder / name)
    return folder


def as_before(eng: LLMEngine) -> None:
    """Makes `eng` the engine as it was: transformers' decode, and a copy of all tokens in every
    output."""
    tokenizer = eng.tokenizer
    eng._decoders[True] = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))
    output = eng._output

    def every_output_copies(req: Request, *args: Any, **kwargs: Any) -> RequestOutput:
        out = output(req, *args, **kwargs)
        out.output_token_ids = list(req.output_token_ids)
        return out

    eng._output = every_output_copies  # type: ignore[method-assign]


def bookkeeping_ms(eng: LLMEngine, batch: int, out: int, steps: int) -> float:
    """Median ms of a decode step's host work outside the runner, at `out` tokens each."""
    execute = eng.runner.execute
    in_runner = [0.0]

    def timed_execute(*args: Any, **kwargs: Any) -> Executed:
        start = time.thread_time()
        try:
            return execute(*args, **kwargs)
        finally:
            in_runner[0] += time.thread_time() - start

    eng.runner.execute = timed_execute  # type: ignore[method-assign]
    vocab = len(eng.tokenizer)
    gen = torch.Generator().manual_seed(batch)
    # greedy: sampling a 49k vocabulary at a temperature costs the CPU more than the model, and
    # it is the runner's time, not what is measured here
    params = SamplingParams(max_tokens=out + steps + 8, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{out}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(0, vocab, (32,), generator=gen).tolist()
        eng.add_request(rid, prompt, params)
    for _ in range(out):
        eng.step()
    times = []
    for _ in range(steps):
        in_runner[0] = 0.0
        start = time.thread_time()
        outputs = eng.step()
        times.append(time.thread_time() - start - in_runner[0])
        if len(outputs) != batch:
            raise RuntimeError(f"a decode step of {batch} returned {len(outputs)} outputs")
    for rid in ids:
        eng.abort_request(rid)
    eng.step()
    eng.runner.execute = execute  # type: ignore[method-assign]
    return 1000 * statistics.median(times)


def engine(folder: Path, max_seqs: int, max_len: int) -> LLMEngine:
    config = EngineConfig(
        model=str(folder),
        device="cpu",
        dtype="float32",
        max_num_seqs=max_seqs,
        max_model_len=max_len,
        max_num_batched_tokens=max(4096, max_seqs * 32),
    )
    return LLMEngine(config, separate_device=True)  # the GPU's layout of the step's inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a folder whose tokenizer to use (SmolLM2's)")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--out", default="100,1000", help="output tokens before the timed steps")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    source = args.model or (SMOLLM2 if (SMOLLM2 / "tokenizer.json").is_file() else None)
    batches = [int(b) for b in args.batches.split(",")]
    outs = [int(o) for o in args.out.split(",")]
    max_len = 32 + max(outs) + args.steps + 16
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_with_tokenizer(source, Path(tmp) / "m")
        print(f"tokenizer: {source or 'make-tiny'}; torch {torch.__version__}, one thread")
        as_it_was, as_it_is = (engine(folder, max(batches), max_len) for _ in range(2))
        as_before(as_it_was)
        print("| batch | output tokens | before ms | now ms | before / now |")
        print("|---|---|---|---|---|")
        for b in batches:
            for o in outs:
                before, now = (bookkeeping_ms(e, b, o, args.steps) for e in (as_it_was, as_it_is))
                print(f"| {b} | {o} | {before:.2f} | {now:.2f} | {before / now:.2f}x |")


if __name__ == "__main__":
    main()
