"""A mixture-of-experts model over real processes: a prefill worker at two tensor-parallel ranks
hands its KV to a decode worker at one, behind the router, and the official client's answer is
transformers' greedy answer on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from phasefleet.api.contract import INTERNAL_TOKEN_ENV
from phasefleet.engine.tiny import make_tiny
from tests.router.router_proc import run_router
from tests.server.worker_proc import run_worker

ARGS = ("--num-kv-blocks", "64", "--block-size", "16", "--device", "cpu")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
TOKENS = 8


def greedy_text(folder: Path, prompt: str, n: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))  # as served


def test_a_mixtral_fleet_hands_off_and_answers_as_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, "internal")  # the hand-off's token
    folder = make_tiny(tmp_path / "tiny-mixtral", arch="mixtral", seed=7)
    members = tmp_path / "workers.json"
    with (
        run_worker(folder, "--role", "prefill", "--tensor-parallel-size", "2", *ARGS) as prefill,
        run_worker(folder, "--role", "decode", "--remote-prefill-min-tokens", "0", *ARGS) as decode,
    ):
        members.write_text(json.dumps({"prefill": [prefill.base_url], "decode": [decode.base_url]}))
        with run_router("--workers-file", str(members), "--refresh-interval", "0.5") as router:
            client = router.client()
            (model,) = [m.id for m in client.models.list().data]
            remote = decode.counter("phasefleet_prefills_total", where="remote")
            reply = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert decode.counter("phasefleet_prefills_total", where="remote") == remote + 1
    assert reply.usage is not None and reply.usage.completion_tokens == TOKENS
    assert reply.choices[0].text == greedy_text(folder, PROMPT, TOKENS)
