"""The chart's dashboard is the generated one, queries only metrics that exist, and the chart's
SLO targets are bucket boundaries the router's histograms really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.utils import floatToGoString

from phasefleet.api.contract import Metric
from phasefleet.api.dashboard import CHART_COPY, KSM_METRICS, PLACEHOLDERS, dashboard_json
from phasefleet.server.metrics import TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "phasefleet"


def panels() -> list[dict]:
    return list(json.loads(dashboard_json())["panels"])


def test_the_charts_copy_is_current() -> None:
    path = ROOT / CHART_COPY
    assert path.exists(), f"{path} missing: run `make dashboard`"
    assert path.read_text() == dashboard_json(), f"{path} is stale: run `make dashboard`"


def test_every_query_names_a_contract_or_kube_state_metric() -> None:
    known = {v for k, v in vars(Metric).items() if k.isupper() and isinstance(v, str)}
    known |= set(KSM_METRICS)
    used = set()
    for panel in panels():
        for target in panel.get("targets", []):
            for name in re.findall(r"\b(phasefleet_\w+|kube_\w+)\{", target["expr"]):
                used.add(re.sub(r"_(bucket|count|sum)$", "", name))
    assert used - known == set()
    # Every worker and router metric a panel is meant to show is on the dashboard.
    for name in (
        Metric.TIME_TO_FIRST_TOKEN,
        Metric.INTER_TOKEN_LATENCY,
        Metric.TIME_PER_OUTPUT_TOKEN,
        Metric.KV_CACHE_USAGE_PERC,
        Metric.PREFILL_TOKENS_PENDING,
        Metric.NUM_PREEMPTIONS_TOTAL,
        Metric.PREFIX_CACHE_HITS_TOTAL,
        Metric.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL,
        Metric.KV_TRANSFER_BYTES_TOTAL,
        Metric.KV_TRANSFER_FAILURES_TOTAL,
        *KSM_METRICS,
    ):
        assert name in used, name


def test_panels_have_ids_titles_and_do_not_overlap() -> None:
    items = panels()
    assert len({p["id"] for p in items}) == len(items)
    cells: set[tuple[int, int]] = set()
    for p in items:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, p["title"]
        cells |= mine
        if p["type"] != "row":
            assert p["targets"] and p["description"]
            assert [t["refId"] for t in p["targets"]] == [
                chr(65 + i) for i in range(len(p["targets"]))
            ]


def test_slo_placeholders_are_all_filled_by_the_chart() -> None:
    text = dashboard_json()
    template = (CHART / "templates" / "dashboard.yaml").read_text()
    for name, placeholder in PLACEHOLDERS.items():
        assert placeholder in text and f"${{{name}}}" in text
        assert f'replace "{placeholder}"' in template


def test_slo_targets_are_the_histograms_bucket_boundaries_as_their_le_label_writes_them() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    slo = schema["properties"]["slo"]["properties"]
    ttft_enum = slo["ttft"]["properties"]["targetSeconds"]["enum"]
    tpot_enum = slo["tpot"]["properties"]["targetSeconds"]["enum"]
    # A string as the le label writes it, or the same number.
    assert ttft_enum == [floatToGoString(b) for b in TTFT_BUCKETS] + list(TTFT_BUCKETS)
    assert tpot_enum == [floatToGoString(b) for b in TOKEN_LATENCY_BUCKETS] + list(
        TOKEN_LATENCY_BUCKETS
    )
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["slo"]["ttft"]["targetSeconds"] in ttft_enum
    assert values["slo"]["tpot"]["targetSeconds"] in tpot_enum
    assert values["dashboard"]["enabled"] is False
