"""Host time of a step's sampling settings: `SamplingBatch.from_rows` and their share of the
step's one upload (`HostStaging`, the GPU path's copy), for B decode rows. On a GPU this is time
the device waits for. Two batches side by side in this process:

- plain: temperature and top-p only (what every request had before logit bias and the
  penalties existed, and what a request that sets none of them still costs);
- adjusted: every row with a 16-token logit bias, repetition, presence and frequency penalties
  and min-p, over a prompt of --prompt tokens and an answer of --out tokens so far (each row's
  output counts are kept up to date as tokens arrive, so a step adds one token to them). Each
  row's prompt tokens go up with its first step and stay on the device
  (`SamplingRow.prompt_on_device`); `adjusted, resent` sends them at every step instead, as
  before that (the baseline, side by side).

Thread CPU time, best of --repeats, each repeat one token later.

    .venv/bin/python bench/sampling_host.py               # B = 1, 64, 256
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from phasefleet.engine.sampler import DeviceSampling, SamplingBatch, SamplingRow
from phasefleet.engine.sampling_params import SamplingParams
from phasefleet.engine.staging import HostStaging

VOCAB = 128_256  # Llama 3's


def rows(batch: int, adjusted: bool, prompt: int, out: int) -> list[SamplingRow]:
    rng = random.Random(0)
    made = []
    for _ in range(batch):
        if not adjusted:
            made.append(SamplingRow(SamplingParams(temperature=0.7, top_p=0.9)))
            continue
        bias = {rng.randrange(VOCAB): 1.0 for _ in range(16)}
        params = SamplingParams(
            temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
            presence_penalty=0.5, frequency_penalty=0.5, logit_bias=bias,
        )  # fmt: skip
        row = SamplingRow(params, output_ids=[rng.randrange(VOCAB) for _ in range(out)])
        row.prompt_ids = np.unique(np.array([rng.randrange(VOCAB) for _ in range(prompt)]))
        made.append(row)
    return made


def host_ms(made: list[SamplingRow], staging: HostStaging, repeats: int, resend: bool) -> float:
    best = float("inf")
    for step in range(repeats):
        for row in made:
            if row.adjusts:
                row.output_ids.append(step)  # the token this step appends
            if resend:
                row.prompt_on_device = None
        start = time.thread_time()
        batch = SamplingBatch.from_rows(made, [1000] * len(made), VOCAB)
        for array in batch.arrays():
            staging.add(array)
        tensors = staging.upload()
        best = min(best, time.thread_time() - start)
        DeviceSampling.take(batch, tensors).prompt_pairs(made)  # the device's part: not timed
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens per row")
    p.add_argument("--out", type=int, default=500, help="answer tokens per row so far")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    staging = HostStaging(torch.device("cpu"), copy=True)
    print(f"torch {torch.__version__}, one thread, CPU time, best of {args.repeats}")
    for b in [int(x) for x in args.batches.split(",")]:
        plain = host_ms(rows(b, False, args.prompt, args.out), staging, args.repeats, False)
        resent = host_ms(rows(b, True, args.prompt, args.out), staging, args.repeats, True)
        adjusted = host_ms(rows(b, True, args.prompt, args.out), staging, args.repeats, False)
        print(
            f"B={b} plain_ms={plain:.3f} adjusted_resent_ms={resent:.3f} "
            f"adjusted_ms={adjusted:.3f} adjusted/plain={adjusted / plain:.1f}x "
            f"resent/adjusted={resent / adjusted:.1f}x"
        )


if __name__ == "__main__":
    main()
