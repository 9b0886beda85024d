"""The generated CRD: in sync with the checked-in copies, structural, useful to kubectl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from phasefleet.api.cli import add_arguments, run
from phasefleet.api.crd import build_crd, crd_yaml

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = [
    ROOT / "crds" / "serving.phasefleet.dev_inferenceservices.yaml",
    ROOT / "helm" / "phasefleet" / "crds" / "serving.phasefleet.dev_inferenceservices.yaml",
]


@pytest.mark.parametrize("path", CHECKED_IN, ids=lambda p: str(p.relative_to(ROOT)))
def test_checked_in_crd_matches_the_models(path: Path):
    assert path.exists(), f"{path} missing: run `make crds`"
    assert path.read_text() == crd_yaml(), f"{path} is stale: run `make crds`"


def test_cli_prints_the_crd(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([])) == 0
    assert capsys.readouterr().out == crd_yaml()
    target = tmp_path / "a" / "crd.yaml"
    assert run(parser.parse_args(["-o", str(target)])) == 0
    assert target.read_text() == crd_yaml()


def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}/{i}")


def _schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        assert "$ref" not in node and "$defs" not in node, path
        assert "title" not in node or "/properties/" in path, path
        if "anyOf" in node and isinstance(node["anyOf"], list):
            assert node.get("x-kubernetes-int-or-string"), f"bare anyOf at {path}"
        if node.get("additionalProperties") is False:
            raise AssertionError(f"additionalProperties: false at {path}")


def test_schema_carries_defaults_enums_bounds_and_descriptions():
    spec = _schema()["properties"]["spec"]
    props = spec["properties"]
    assert props["mode"]["enum"] == ["disaggregated", "aggregated"]
    assert props["mode"]["default"] == "disaggregated"
    pool = props["prefill"]["properties"]
    assert pool["replicas"]["minimum"] == 0 and pool["replicas"]["default"] == 1
    assert "tokens" in pool["maxNumBatchedTokens"]["description"]
    limits = pool["resources"]["properties"]["limits"]["additionalProperties"]
    assert limits["x-kubernetes-int-or-string"] is True
    assert pool["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    assert props["router"]["default"] == {}
    assert props["autoscaling"]["properties"]["kvCacheTarget"]["maximum"] == 1.0


def test_preserve_unknown_fields_only_on_passthrough_core_types():
    paths = [p for p, n in _walk(_schema()) if n.get("x-kubernetes-preserve-unknown-fields")]
    assert all(p.endswith(("/affinity", "/valueFrom")) for p in paths), paths


def test_cel_rules_name_their_fields():
    rules = [r for _, n in _walk(_schema()) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 8
    for rule in rules:
        names_field = (
            "fieldPath" in rule or "spec." in rule["message"] or "metadata." in rule["message"]
        )
        assert rule["message"] and names_field, rule


def test_status_subresource_and_printer_columns():
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == [
        "Mode", "Prefill", "Decode", "Workers", "TTFT", "TPOT", "KV", "Scale", "Ready", "Age"
    ]  # fmt: skip


def test_yaml_has_no_anchors():
    text = crd_yaml()
    assert "&id" not in text and "*id" not in text
    assert yaml.safe_load(text) == build_crd()


def test_console_script_crd_subcommand(capsys: pytest.CaptureFixture[str]):
    from phasefleet.cli import main

    assert main(["crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "CustomResourceDefinition"
