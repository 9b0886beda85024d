"""SamplingParams and EngineConfig reject bad values with a message naming the field."""

from __future__ import annotations

import pytest

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.sampling_params import (
    API_SEED_MAX,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=MAX_TEMPERATURE * 2), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(seed="x"), "seed"),
        (dict(seed=SEED_MAX + 1), "seed"),  # torch.Generator.manual_seed would raise
        (dict(seed=SEED_MIN - 1), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop="abc"), "stop"),
        (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
        (dict(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got "):
        SamplingParams(**kwargs).validate()  # type: ignore[arg-type]


def test_default_sampling_params_are_valid() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0, top_k=0, top_p=1.0, seed=3, stop=["x"]).validate()


def test_the_bounds_themselves_are_valid() -> None:
    for seed in (SEED_MIN, SEED_MAX, API_SEED_MAX + MAX_N - 1):
        SamplingParams(seed=seed).validate()
    SamplingParams(
        temperature=MAX_TEMPERATURE,
        top_p=5e-324,
        top_k=10**30,
        stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        stop_token_ids=[0] * MAX_STOP_TOKEN_IDS,
    ).validate()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(model=""), "model"),
        (dict(dtype="float64"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(block_size=0), "block_size"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
        (dict(num_kv_blocks=1), "num_kv_blocks"),
        (dict(max_model_len=-5), "max_model_len"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(late_after_s=0.0), "late_after_s"),
        (dict(late_after_s=2.0, late_limit_s=1.0), "late_limit_s"),
    ],
)
def test_engine_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    config = EngineConfig(**{"model": "/models/x", **kwargs})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got "):
        config.validate()


def test_default_engine_config_is_valid() -> None:
    EngineConfig(model="/models/x").validate()
