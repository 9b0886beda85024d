"""The InferenceService CustomResourceDefinition, generated from the pydantic models.

pydantic writes JSON Schema (with $refs, anyOf-with-null for optionals, titles); Kubernetes
wants a structural OpenAPI v3 schema (everything inline, one type per node). `structural`
turns the first into the second.
"""

from __future__ import annotations

from typing import Any

import yaml

from phasefleet.api.names import NAME_RULES, SERVICE_RULES
from phasefleet.api.spec import InferenceServiceSpec
from phasefleet.api.status import InferenceServiceStatus

GROUP = "serving.phasefleet.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["isvc", "pfis"]
API_VERSION = f"{GROUP}/{VERSION}"

# Keywords Kubernetes' structural schema accepts that we pass through unchanged.
_KEPT = {
    "type",
    "description",
    "default",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "nullable",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
}


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline $refs, collapse Optional[X] to X, drop what Kubernetes rejects."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return structural(merged, defs)
    any_of = node.get("anyOf")
    if any_of and not node.get("x-kubernetes-int-or-string"):
        options = [o for o in any_of if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {any_of} in a structural schema")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", "unset") is None:
            del rest["default"]
        return structural({**options[0], **rest}, defs)

    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEPT}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "exclusiveMinimum" in node or "exclusiveMaximum" in node:
        raise ValueError(f"use ge/le, not gt/lt: {node}")
    if "const" in node:
        out["enum"] = [node["const"]]
    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {k: structural(v, defs) for k, v in node["properties"].items()}
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(node["additionalProperties"], defs)
    if "items" in node:
        out["items"] = structural(node["items"], defs)
    if out.get("type") == "array" and "x-kubernetes-list-type" not in out:
        out["x-kubernetes-list-type"] = "atomic"
    return out


def _schema(model: type[InferenceServiceSpec] | type[InferenceServiceStatus]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


_POOL_READY = "Ready replicas / desired replicas"

PRINTER_COLUMNS = [
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    # Each mode fills its own pool columns and leaves the others blank.
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefillReady",
     "description": f"{_POOL_READY} of the prefill pool (disaggregated)"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decodeReady",
     "description": f"{_POOL_READY} of the decode pool (disaggregated)"},
    {"name": "Workers", "type": "string", "jsonPath": ".status.workersReady",
     "description": f"{_POOL_READY} of the worker pool (aggregated)"},
    {"name": "TTFT", "type": "number", "jsonPath": ".status.metrics.ttftMs",
     "description": "Time to first token at the SLO percentile (ms)"},
    {"name": "TPOT", "type": "number", "jsonPath": ".status.metrics.tpotMs",
     "description": "Time per output token at the SLO percentile (ms)"},
    {"name": "KV", "type": "number", "jsonPath": ".status.metrics.kvCacheUsage",
     "description": "Decode KV-cache usage (0..1)"},
    {"name": "Scale", "type": "string", "jsonPath": ".status.scale",
     "description": "ScaledToZero, WakingFromZero, or blank"},
    {"name": "Ready", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]  # fmt: skip


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a dict, ready for yaml.safe_dump or the API server."""
    spec_schema = _schema(InferenceServiceSpec)
    status_schema = _schema(InferenceServiceStatus)
    status_schema["description"] = "Observed state, written by the operator and the autoscaler."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "phasefleet"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["phasefleet"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (
                                "InferenceService serves one LLM with separately scaled "
                                "prefill and decode pools behind a router."
                            ),
                            "required": ["spec"],
                            "x-kubernetes-validations": [
                                r.to_schema() for r in (*NAME_RULES, *SERVICE_RULES)
                            ],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared sub-schemas out in full: `kubectl explain` readers expect no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    header = "# Generated by `phasefleet crd` from phasefleet.api; do not edit by hand.\n"
    body = yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)
    return header + body
