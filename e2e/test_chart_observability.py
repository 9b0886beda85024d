"""The chart's dashboard and alerts as `helm template` renders them: each appears only when asked
(the PrometheusRule also only when its API exists), the values schema refuses an SLO target that
is no bucket boundary, and the rendered rules pass `promtool check rules` and the
`promtool test rules` cases in e2e/promtool/alerts_test.yaml, which fire and clear every alert.
Last, a real install: with the PrometheusRule CRD on the e2e control plane, `helm install`
creates the rule and the dashboard's ConfigMap, and the API server keeps them as rendered.

Here, not in tests/: helm comes from the e2e tool cache and promtool from Debian's prometheus
package, both installed by `make tools`, which runs before the e2e stage only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e.harness.chart import (
    CHART,
    KUBE_VERSION,
    ROOT,
    RULE_API,
    helm,
    kinds,
    monitoring_crd,
    one,
    render,
    rendered_dashboard,
    rule_groups,
)
from e2e.harness.controlplane import ControlPlane

PROMTOOL_CASES = ROOT / "e2e" / "promtool" / "alerts_test.yaml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool missing: run `make tools` (e2e/tools/install-prometheus.sh)")
    return found


def test_dashboard_and_rules_render_only_when_asked_for() -> None:
    plain = render()
    assert "ConfigMap" not in kinds(plain) and "PrometheusRule" not in kinds(plain)
    assert "PrometheusRule" in kinds(render(RULE_API))
    assert "PrometheusRule" not in kinds(render(RULE_API, "--set", "prometheusRule.enabled=false"))
    lint = helm(
        "lint", "--strict", str(CHART), KUBE_VERSION, "--set", "dashboard.enabled=true",
        check=False,
    )  # fmt: skip
    assert lint.returncode == 0 and "[WARNING]" not in lint.stdout, lint.stdout + lint.stderr


def test_dashboard_config_map_is_labelled_for_the_grafana_sidecar() -> None:
    default = one(render("--set", "dashboard.enabled=true"), "ConfigMap")
    assert default["metadata"]["namespace"] == "pf"
    assert default["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in default["metadata"]

    custom = one(
        render(
            "--set", "dashboard.enabled=true", "--set", "dashboard.labelKey=dashboards",
            "--set", "dashboard.labelValue=phasefleet", "--set", "dashboard.namespace=grafana",
            "--set", "dashboard.folder=LLM serving", "--set", "dashboard.labels.team=ml",
        ),
        "ConfigMap",
    )  # fmt: skip
    meta = custom["metadata"]
    assert meta["namespace"] == "grafana"
    assert meta["labels"]["dashboards"] == "phasefleet" and meta["labels"]["team"] == "ml"
    assert "grafana_dashboard" not in meta["labels"]
    assert meta["annotations"] == {"grafana_folder": "LLM serving"}


def test_dashboard_and_alerts_take_the_slo_from_values() -> None:
    # A number as --set writes it ("1"), or a string; both become the le label's "1.0".
    args: tuple[str, ...] = ("--set", "slo.ttft.targetSeconds=1")
    args += ("--set-string", "slo.tpot.targetSeconds=0.05")
    args += ("--set-json", "slo.ttft.objective=0.995")
    constants = {
        v["name"]: v["query"]
        for v in rendered_dashboard(*args)["templating"]["list"]
        if v["type"] == "constant"
    }
    assert constants == {
        "ttft_target": "1.0",
        "tpot_target": "0.05",
        "ttft_objective": "0.995",
        "tpot_objective": "0.99",
    }
    rules = [r for g in rule_groups(*args) for r in g["rules"]]
    records = {r["record"]: r["expr"] for r in rules if "record" in r}
    assert 'le="1.0"' in records["phasefleet:ttft_slo_errors:ratio_rate5m"]
    assert 'le="0.05"' in records["phasefleet:tpot_slo_errors:ratio_rate1h"]
    ttft_burns = [r["expr"] for r in rules if r.get("alert") == "PhaseFleetTTFTErrorBudgetBurn"]
    assert ["14.4 * (1 - 0.995)" in e for e in ttft_burns] == [True, False]
    assert ["6 * (1 - 0.995)" in e for e in ttft_burns] == [False, True]


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("slo.ttft.targetSeconds=0.3", "/slo/ttft/targetSeconds': value must be one of"),
        ("slo.tpot.targetSeconds=0.12", "/slo/tpot/targetSeconds': value must be one of"),
        ("dashboard.labelKey=", "/dashboard/labelKey"),
    ],
)
def test_schema_refuses_targets_off_the_bucket_boundaries(setting: str, complaint: str) -> None:
    result = helm("template", "t", str(CHART), KUBE_VERSION, "--set", setting, check=False)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr


def test_schema_refuses_an_objective_the_fast_burn_alert_could_never_reach() -> None:
    result = helm(
        "template", "t", str(CHART), KUBE_VERSION, "--set-json", "slo.tpot.objective=0.9",
        check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "/slo/tpot/objective" in result.stderr, result.stderr


def test_rules_pass_promtool_check_and_every_alert_fires_and_clears(tmp_path: Path) -> None:
    groups = rule_groups()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(PROMTOOL_CASES, tmp_path / "alerts_test.yaml")
    check = subprocess.run(
        [promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    test = subprocess.run(
        [promtool(), "test", "rules", "alerts_test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr

    # Each alert of the chart has a case where it fires and a later one where it has cleared.
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    cases = yaml.safe_load(PROMTOOL_CASES.read_text())["tests"]
    for alert in alerts:
        evals = sorted(
            (_minutes(e["eval_time"]), bool(e["exp_alerts"]))
            for case in cases
            for e in case.get("alert_rule_test", [])
            if e["alertname"] == alert
        )
        fired = [t for t, firing in evals if firing]
        assert fired, f"{alert}: no case where it fires"
        assert any(not firing and t > fired[0] for t, firing in evals), f"{alert} never clears"


def _minutes(duration: str) -> int:
    assert duration.endswith("m"), duration
    return int(duration[:-1])


RULE_CRD = monitoring_crd("PrometheusRule")


@pytest.fixture
def rule_crd(cluster: ControlPlane) -> Iterator[None]:
    name = f"crd/{RULE_CRD['metadata']['name']}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(RULE_CRD))
    cluster.kubectl("wait", "--for=condition=Established", name)
    yield
    cluster.kubectl("delete", name, "--wait=true")


def test_install_creates_the_rule_when_its_api_exists_and_the_dashboard(
    cluster: ControlPlane, namespace: str, rule_crd: None
) -> None:
    release = "obs"
    cluster.helm(
        "install", release, str(CHART), "-n", namespace, "--wait", "--timeout", "120s",
        "--set", "replicaCount=0", "--set", f"watchNamespaces={{{namespace}}}",
        "--set", "dashboard.enabled=true",
    )  # fmt: skip
    try:
        rule = cluster.get_json("prometheusrule", f"{release}-phasefleet-alerts", "-n", namespace)
        assert rule["spec"]["groups"] == rule_groups()
        dashboard = cluster.get_json(
            "configmap", f"{release}-phasefleet-dashboard", "-n", namespace
        )
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["phasefleet.json"]) == rendered_dashboard()
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait")
