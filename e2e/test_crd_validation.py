"""The generated CRD on a real API server: accepted, defaults applied, invalid objects rejected
with a message that names the field (the same cases tests/api feeds to pydantic)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.controlplane import ControlPlane
from phasefleet.api.crd import crd_yaml
from phasefleet.api.names import MAX_NAME_LENGTH, InvalidService, validate_service
from phasefleet.cli import main
from tests.api.cases import example_services, invalid_cases


@pytest.fixture(scope="module")
def crd(cluster: ControlPlane) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input=crd_yaml())
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/inferenceservices.serving.phasefleet.dev"
    )


def _isvc(name: str, spec: dict[str, Any]) -> str:
    return json.dumps(
        {
            "apiVersion": "serving.phasefleet.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


@pytest.mark.parametrize(
    ("case", "name", "spec", "field"), invalid_cases(), ids=lambda v: str(v)[:40]
)
def test_invalid_service_is_rejected_naming_the_field(
    cluster: ControlPlane,
    crd: None,
    namespace: str,
    case: str,
    name: str,
    spec: dict[str, Any],
    field: str,
) -> None:
    result = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=_isvc(name, spec), check=False
    )
    assert result.returncode != 0, f"{case} was accepted"
    assert "is invalid" in result.stderr, result.stderr
    assert field in result.stderr, f"{case}: {field} not named in: {result.stderr}"
    with pytest.raises(InvalidService):  # and so does the operator's Python mirror
        validate_service(name, spec)


@pytest.mark.parametrize(("filename", "obj"), example_services(), ids=lambda v: str(v)[:30])
def test_examples_are_accepted_and_defaulted(
    cluster: ControlPlane, crd: None, namespace: str, filename: str, obj: dict[str, Any]
) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(obj))
    stored = cluster.get_json("inferenceservice", obj["metadata"]["name"], "-n", namespace)
    spec = stored["spec"]
    assert spec["router"]["replicas"] >= 1
    assert spec["runtime"]["blockSize"] == obj["spec"].get("runtime", {}).get("blockSize", 16)
    for role in ("prefill", "decode", "worker"):
        if role in spec:
            assert spec[role]["terminationGracePeriodSeconds"] >= 0


@pytest.mark.parametrize(("rate", "tpot_ms"), [(2.0, 60), (20.0, 40)], ids=["light", "tight"])
def test_a_planned_service_is_accepted(
    cluster: ControlPlane, crd: None, namespace: str, tmp_path: Path, rate: float, tpot_ms: int
) -> None:
    """`phasefleet plan` writes what the API server takes, whichever mode it picks."""
    rows = [f"{i / rate:.3f},{200 + (i * 37) % 900},{10 + (i * 11) % 90}" for i in range(600)]
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    out = tmp_path / "planned.yaml"
    argv = ["plan", "--trace", str(trace), "--ttft-ms", "800", "--tpot-ms", str(tpot_ms)]
    assert main([*argv, "--gpu", "l40s", "--max-gpus", "16", "-o", str(out)]) == 0
    cluster.kubectl("apply", "-n", namespace, "-f", str(out))
    stored = cluster.get_json("inferenceservice", "planned", "-n", namespace)
    assert stored["spec"]["autoscaling"]["enabled"] is True
    assert stored["spec"]["slo"]["tpotMs"] == tpot_ms


def test_the_longest_allowed_name_is_accepted(
    cluster: ControlPlane, crd: None, namespace: str
) -> None:
    spec = {"model": {"image": {"path": "/m"}}, "prefill": {}, "decode": {}}
    name = "x" * MAX_NAME_LENGTH
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=_isvc(name, spec))
    assert validate_service(name, spec).prefill is not None


def test_kubectl_explain_describes_fields(cluster: ControlPlane, crd: None) -> None:
    out = cluster.kubectl("explain", "inferenceservice.spec.prefill.maxNumBatchedTokens").stdout
    assert "tokens" in out
    out = cluster.kubectl("explain", "inferenceservice.spec.mode").stdout
    assert "aggregated" in out
