"""Small factories for operator tests."""

from __future__ import annotations

import copy
from typing import Any

from phasefleet.api.spec import InferenceServiceSpec, parse_spec
from phasefleet.operator.meta import Owner

NAMESPACE = "team-a"


def make_spec_dict(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"image": {"path": "/models/tiny"}},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
    }
    spec.update(copy.deepcopy(overrides))
    return spec


def make_spec(**overrides: Any) -> InferenceServiceSpec:
    return parse_spec(make_spec_dict(**overrides))


def make_owner(name: str = "llm") -> Owner:
    return Owner(name=name, namespace=NAMESPACE, uid=f"uid-{name}")


def make_isvc(name: str = "llm", **overrides: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "generation": 1},
        "spec": make_spec_dict(**overrides),
    }
