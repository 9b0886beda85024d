"""The pydantic models validate specs with the same rules the CRD gives the API server."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from phasefleet.api.names import (
    CHILD_SUFFIXES,
    MAX_NAME_LENGTH,
    InvalidService,
    name_problem,
    validate_service,
)
from phasefleet.api.spec import InferenceServiceSpec, Mode, Role, parse_spec, pool_gpus
from tests.api.cases import example_services, invalid_cases


@pytest.mark.parametrize(
    ("case", "name", "spec", "field"), invalid_cases(), ids=lambda v: str(v)[:40]
)
def test_invalid_service_is_rejected_naming_the_field(
    case: str, name: str, spec: dict[str, Any], field: str
):
    with pytest.raises(InvalidService) as info:
        validate_service(name, spec)
    text = str(info.value)
    if field.startswith("metadata."):
        assert field in text and name in text, f"{case}: error does not name {field}: {text}"
    for part in field.removeprefix("spec.").split("."):
        assert part in text, f"{case}: error does not name {field}: {text}"


@pytest.mark.parametrize("name", ["llama-3-1-8b", "a", "x" * MAX_NAME_LENGTH, "m2"])
def test_names_whose_children_are_valid_service_names_are_accepted(name: str):
    assert name_problem(name) is None
    for suffix in CHILD_SUFFIXES:
        child = name + suffix
        assert len(child) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", child), child


@pytest.mark.parametrize("name", ["llama-3.1-8b", "Llama", "8b-model", "x" * (MAX_NAME_LENGTH + 1)])
def test_names_that_make_invalid_children_are_rejected_saying_why(name: str):
    problem = name_problem(name)
    assert problem is not None and "Service" in problem and repr(name) in problem


def test_runtime_env_may_set_other_variables():
    spec = parse_spec(
        {
            "model": {"image": {"path": "/m"}},
            "prefill": {},
            "decode": {},
            "runtime": {"env": [{"name": "LOG_LEVEL", "value": "debug"}]},
        }
    )
    assert spec.runtime.env[0].name == "LOG_LEVEL"


@pytest.mark.parametrize(("filename", "obj"), example_services(), ids=lambda v: str(v)[:30])
def test_examples_are_valid(filename: str, obj: dict[str, Any]):
    spec = parse_spec(obj["spec"])
    assert spec.pools()


def test_defaults_fill_in_a_minimal_spec():
    spec = parse_spec({"model": {"hf": {"repoId": "org/m"}}, "prefill": {}, "decode": {}})
    assert spec.mode is Mode.DISAGGREGATED
    assert set(spec.pools()) == {Role.PREFILL, Role.DECODE}
    assert spec.router.replicas == 1 and spec.router.policy == "least-loaded"
    assert spec.runtime.block_size == 16
    assert spec.autoscaling.enabled is False
    assert spec.prefill is not None and spec.prefill.min_size == spec.prefill.max_size == 1


def test_gpu_budget_counts_minimum_replicas_times_gpus():
    spec = parse_spec(
        {
            "model": {"image": {"path": "/m"}},
            "prefill": {
                "replicas": 2,
                "minReplicas": 1,
                "tensorParallelSize": 2,
                "resources": {"limits": {"nvidia.com/gpu": "2"}},
            },
            "decode": {"replicas": 3, "resources": {"limits": {"nvidia.com/gpu": 1}}},
            "autoscaling": {"gpuBudget": 5},
        }
    )
    assert spec.min_gpus() == 1 * 2 + 3 * 1


def _pool(**fields: Any) -> dict[str, Any]:
    spec = parse_spec({"model": {"image": {"path": "/m"}}, "prefill": fields, "decode": {}})
    assert spec.prefill is not None
    return {"degree": spec.prefill.tensor_parallel_size, "gpus": pool_gpus(spec.prefill)}


def test_tensor_parallel_size_defaults_to_one_rank_on_the_pool_gpu_or_not():
    assert _pool() == {"degree": 1, "gpus": 0}
    assert _pool(resources={"limits": {"nvidia.com/gpu": 1}}) == {"degree": 1, "gpus": 1}


@pytest.mark.parametrize("degree", [1, 2, 4, 8, 16, 32, 64])
def test_a_gpu_pool_asks_one_gpu_per_rank(degree: int):
    gpus = {"limits": {"nvidia.com/gpu": str(degree)}}
    assert _pool(tensorParallelSize=degree, resources=gpus) == {"degree": degree, "gpus": degree}


def test_a_pool_without_a_gpu_limit_runs_its_ranks_on_cpu():
    assert _pool(tensorParallelSize=4) == {"degree": 4, "gpus": 0}
    assert _pool(tensorParallelSize=4, resources={"limits": {"nvidia.com/gpu": 0}}) == {
        "degree": 4,
        "gpus": 0,
    }


def test_gpu_budget_counts_each_replica_at_its_degree():
    spec = parse_spec(
        {
            "model": {"image": {"path": "/m"}},
            "prefill": {
                "replicas": 2,
                "tensorParallelSize": 8,
                "resources": {"limits": {"nvidia.com/gpu": 8}},
            },
            "decode": {"replicas": 3, "tensorParallelSize": 2},  # CPU ranks: no GPUs
            "autoscaling": {"gpuBudget": 16},
        }
    )
    assert spec.min_gpus() == 2 * 8


def test_pools_may_scale_to_zero_with_a_hold_bound_and_an_idle_window():
    spec = parse_spec(
        {
            "model": {"image": {"path": "/m"}},
            "mode": "aggregated",
            "worker": {"replicas": 1, "minReplicas": 0, "maxReplicas": 2},
            "autoscaling": {"enabled": True, "scaleToZeroAfterSeconds": 30},
            "router": {"holdSeconds": 60, "maxHeldRequests": 20},
        }
    )
    assert spec.worker is not None and spec.worker.min_size == 0
    assert spec.autoscaling.scale_to_zero_after_seconds == 30
    assert (spec.router.hold_seconds, spec.router.max_held_requests) == (60, 20)
    defaults = parse_spec({"model": {"image": {"path": "/m"}}, "prefill": {}, "decode": {}})
    assert defaults.autoscaling.scale_to_zero_after_seconds == 600
    assert (defaults.router.hold_seconds, defaults.router.max_held_requests) == (120, 256)


def test_wire_form_round_trips_in_camel_case():
    spec = parse_spec(example_services()[0][1]["spec"])
    wire = spec.to_wire()
    assert "maxNumBatchedTokens" in wire[next(iter(r.value for r in spec.pools()))]
    assert InferenceServiceSpec.model_validate(wire) == spec


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="replica"):
        parse_spec({"model": {"image": {"path": "/m"}}, "prefill": {"replica": 2}, "decode": {}})
