"""The model's sampling defaults (generation_config.json) for the fields a request leaves out:
read as vLLM's `--generation-config auto` reads them, refused when out of bounds, and served
by a real worker through the official client."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from phasefleet.engine.tiny import make_tiny
from phasefleet.server.generation import sampling_params
from phasefleet.server.openai_protocol import CompletionRequest
from phasefleet.server.sampling_defaults import SamplingDefaults
from tests.server.worker_proc import run_worker


def write(folder: Path, config: object) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_only_the_fields_the_file_sets_are_taken(tmp_path: Path) -> None:
    assert SamplingDefaults.of_model(tmp_path) == SamplingDefaults()  # no file: the API's
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}
    defaults = SamplingDefaults.of_model(write(tmp_path, qwen3))
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert defaults.overridden() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert SamplingDefaults.of_model(write(tmp_path, {"top_k": 0})).top_k == -1  # no cut
    assert SamplingDefaults.of_model(write(tmp_path, {"max_new_tokens": 64})).max_tokens == 64
    both = {"repetition_penalty": 1.1, "min_p": 0.05, "temperature": None}
    assert SamplingDefaults.of_model(write(tmp_path, both)) == SamplingDefaults(
        min_p=0.05, repetition_penalty=1.1
    )


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"temperature": -1}, "generation_config.json: temperature must be"),
        ({"top_p": 0}, "generation_config.json: top_p must be in"),
        ({"top_k": "many"}, "generation_config.json: top_k must be"),
        ({"max_new_tokens": 0}, "generation_config.json: max_new_tokens must be an integer"),
        ({"max_new_tokens": 2.5}, "generation_config.json: max_new_tokens must be an integer"),
        ([1, 2], "generation_config.json is not a JSON object"),
    ],
)
def test_out_of_bounds_defaults_are_refused_naming_the_file(
    tmp_path: Path, config: object, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        SamplingDefaults.of_model(write(tmp_path, config))


def test_a_request_field_wins_over_the_default() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.1)
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    left_out = sampling_params(request, 8, 0, defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p) == (
        0.6, 0.95, 20, 0.1,
    )  # fmt: skip
    given = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "temperature": 1.0, "top_k": -1, "min_p": 0.0}
    )
    params = sampling_params(given, 8, 0, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 0.95, -1, 0.0)


def test_the_models_max_new_tokens_is_a_default_not_a_cap() -> None:
    assert SamplingDefaults().max_tokens_or(16) == 16  # completions: the API's 16
    assert SamplingDefaults().max_tokens_or(None) is None  # chat: up to the context
    assert SamplingDefaults(max_tokens=8).max_tokens_or(16) == 8
    assert SamplingDefaults(max_tokens=512).max_tokens_or(16) == 16
    assert SamplingDefaults(max_tokens=512).max_tokens_or(None) == 512


def test_a_worker_samples_with_the_models_defaults(tmp_path: Path) -> None:
    """A model whose generation_config.json says temperature 0 answers a request that leaves
    temperature out greedily, whatever its seed; a request that asks temperature 1 samples.
    Its max_new_tokens bounds a chat answer that names no max_tokens."""
    folder = make_tiny(tmp_path / "flat", arch="llama", seed=3, init_std=0.02)  # flat logits
    config = json.loads((folder / "generation_config.json").read_text())
    write(folder, {**config, "temperature": 0.0, "max_new_tokens": 7})
    with run_worker(folder) as worker:
        client = worker.client()

        def answer(temperature: float | None = None, seed: int | None = None) -> str:
            reply = client.completions.create(
                model="tiny", prompt="The sea", max_tokens=12, extra_body={"ignore_eos": True},
                temperature=openai.omit if temperature is None else temperature,
                seed=openai.omit if seed is None else seed,
            )  # fmt: skip
            return reply.choices[0].text

        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}],
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert chat.usage is not None and chat.usage.completion_tokens == 7
        assert chat.choices[0].finish_reason == "length"
        greedy = answer(temperature=0)
        assert answer(seed=1) == answer(seed=2) == greedy
        sampled = {answer(temperature=1.0, seed=s) for s in (1, 2, 3)}
        assert len(sampled) > 1 and greedy not in sampled
