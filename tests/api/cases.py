"""Loads tests/api/invalid_cases.yaml and the examples, for the API tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
INVALID_CASES = Path(__file__).with_name("invalid_cases.yaml")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def invalid_cases() -> list[tuple[str, str, dict[str, Any], str]]:
    """(case, metadata.name, spec, field the error must name) for every invalid case."""
    data = yaml.safe_load(INVALID_CASES.read_text())
    return [
        (
            c["name"],
            c.get("metadataName", c["name"]),
            merge_patch(data["base"], c["patch"]),
            c["field"],
        )
        for c in data["cases"]
    ]


def example_services() -> list[tuple[str, dict[str, Any]]]:
    """(file name, InferenceService object) for every InferenceService in examples/."""
    out = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                out.append((path.name, doc))
    return out
