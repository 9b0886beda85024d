"""The Grafana dashboard the chart ships (helm/phasefleet/dashboards/phasefleet.json).

Built from the metric names in `phasefleet.api.contract`, so a renamed metric renames every
panel's query. The SLO targets and objectives are placeholders that the chart's ConfigMap fills
from the values `slo.*` (the same numbers its alerts use). Regenerate the chart's copy with
`make dashboard` (`python -m phasefleet.api.dashboard`); tests/api/test_dashboard.py fails when
it is stale. docs/observability.md explains each panel.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from phasefleet.api.contract import ROUTER_ROLE
from phasefleet.api.contract import Metric as M

UID = "phasefleet-inferenceservice"
TITLE = "PhaseFleet / InferenceService"
CHART_COPY = Path("helm/phasefleet/dashboards/phasefleet.json")

# Filled by the chart (templates/dashboard.yaml) from .Values.slo.
PLACEHOLDERS = {
    "ttft_target": "__PHASEFLEET_TTFT_TARGET_SECONDS__",
    "tpot_target": "__PHASEFLEET_TPOT_TARGET_SECONDS__",
    "ttft_objective": "__PHASEFLEET_TTFT_OBJECTIVE__",
    "tpot_objective": "__PHASEFLEET_TPOT_OBJECTIVE__",
}
QUANTILES = (0.5, 0.9, 0.99)
WINDOW = "$__rate_interval"
SERVICE = 'namespace="$namespace", inferenceservice="$inferenceservice"'
ROUTER = f'{SERVICE}, role="{ROUTER_ROLE}"'
WORKERS = f'{SERVICE}, role!="{ROUTER_ROLE}"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# kube-state-metrics' Deployment series (kube-prometheus-stack installs it); the operator names
# each pool's Deployment `<service>-<pool>`.
KSM_DEPLOYMENTS = (
    'namespace="$namespace", deployment=~"$inferenceservice-(prefill|decode|worker|router)"'
)
KSM_METRICS = ("kube_deployment_spec_replicas", "kube_deployment_status_replicas_ready")


def target(expr: str, legend: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend}


def rate(metric: str, selector: str) -> str:
    return f"rate({metric}{{{selector}}}[{WINDOW}])"


def quantiles(histogram: str) -> list[dict[str, Any]]:
    """The router's p50/p90/p99 of a latency histogram (what the users see)."""
    buckets = f"sum by (le) ({rate(histogram + '_bucket', ROUTER)})"
    return [target(f"histogram_quantile({q}, {buckets})", f"p{round(q * 100)}") for q in QUANTILES]


def share_within(histogram: str, le: str) -> str:
    """The SLI: the share of the router's requests at or under the target bucket boundary."""
    at_target = ROUTER + ', le="' + le + '"'
    good = f"sum({rate(histogram + '_bucket', at_target)})"
    return f"{good} / sum({rate(histogram + '_count', ROUTER)})"


def panel(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    unit: str,
    right: tuple[str, str] | None = None,
    **defaults: Any,
) -> dict[str, Any]:
    """`right`: (refId, unit) of a query drawn on a right-hand axis in its own unit."""
    overrides = []
    if right is not None:
        ref, right_unit = right
        overrides.append(
            {
                "matcher": {"id": "byFrameRefID", "options": ref},
                "properties": [
                    {"id": "unit", "value": right_unit},
                    {"id": "custom.axisPlacement", "value": "right"},
                ],
            }
        )
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": overrides},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": targets,
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def panels() -> list[dict[str, Any]]:
    """Every row and panel, in reading order (docs/observability.md follows this order)."""
    ttft_target, tpot_target = "vector(${ttft_target})", "vector(${tpot_target})"
    return [
        row("Latency at the router (what clients see)"),
        panel(
            "Time to first token",
            "Router-side TTFT quantiles against the TTFT SLO target.",
            [*quantiles(M.TIME_TO_FIRST_TOKEN), target(ttft_target, "SLO target")],
            "s",
        ),
        panel(
            "Time per output token",
            "Router-side TPOT quantiles (per request) against the TPOT SLO target.",
            [*quantiles(M.TIME_PER_OUTPUT_TOKEN), target(tpot_target, "SLO target")],
            "s",
        ),
        panel(
            "Inter-token latency",
            "Router-side gaps between consecutive tokens, against the TPOT SLO target.",
            [*quantiles(M.INTER_TOKEN_LATENCY), target(tpot_target, "TPOT SLO target")],
            "s",
        ),
        panel(
            "Requests within the SLO targets",
            "Share of requests whose TTFT (TPOT) is at or under the target bucket; the alerts "
            "burn error budget when it stays under the objective.",
            [
                target(share_within(M.TIME_TO_FIRST_TOKEN, "${ttft_target}"), "TTFT"),
                target(share_within(M.TIME_PER_OUTPUT_TOKEN, "${tpot_target}"), "TPOT"),
                target("vector(${ttft_objective})", "TTFT objective"),
                target("vector(${tpot_objective})", "TPOT objective"),
            ],
            "percentunit",
            max=1,
        ),
        row("Traffic"),
        panel(
            "Requests",
            "Requests finished per second at the router.",
            [target(f"sum({rate(M.E2E_REQUEST_LATENCY + '_count', ROUTER)})", "requests/s")],
            "reqps",
        ),
        panel(
            "Tokens",
            "Prompt tokens prefilled and output tokens generated per second, by engine role.",
            [
                target(
                    f"sum by (role) ({rate(M.PROMPT_TOKENS_TOTAL, WORKERS)})", "prompt {{role}}"
                ),
                target(
                    f"sum by (role) ({rate(M.GENERATION_TOKENS_TOTAL, WORKERS)})",
                    "generated {{role}}",
                ),
            ],
            "short",
        ),
        row("Capacity"),
        panel(
            "KV cache usage per pod",
            "Used KV blocks over all KV blocks on each worker, now and at its highest of the"
            " last 30 s (the peak the autoscaler sizes decode for).",
            [
                target(f"max by (pod) ({M.KV_CACHE_USAGE_PERC}{{{WORKERS}}})", "{{pod}}"),
                target(
                    f"max by (pod) ({M.KV_CACHE_USAGE_PEAK_PERC}{{{WORKERS}}})",
                    "{{pod}} peak 30 s",
                ),
            ],
            "percentunit",
            max=1,
        ),
        panel(
            "Prefill backlog",
            "Prompt tokens admitted but not yet prefilled, prompt tokens of queued requests, and"
            " requests queued, by engine role.",
            [
                target(
                    f"sum by (role) ({M.PREFILL_TOKENS_PENDING}{{{WORKERS}}})", "tokens {{role}}"
                ),
                target(
                    f"sum by (role) ({M.PREFILL_TOKENS_WAITING}{{{WORKERS}}})",
                    "queued tokens {{role}}",
                ),
                target(
                    f"sum by (role) ({M.NUM_REQUESTS_WAITING}{{{WORKERS}}})", "waiting {{role}}"
                ),
            ],
            "short",
        ),
        panel(
            "Replicas per pool",
            "Desired and ready replicas of each pool's Deployment (kube-state-metrics), and the "
            "pods Prometheus scrapes PhaseFleet series from.",
            [
                target(
                    f"max by (deployment) ({KSM_METRICS[0]}{{{KSM_DEPLOYMENTS}}})",
                    "{{deployment}} desired",
                ),
                target(
                    f"max by (deployment) ({KSM_METRICS[1]}{{{KSM_DEPLOYMENTS}}})",
                    "{{deployment}} ready",
                ),
                target(
                    f"count by (pool) ({M.E2E_REQUEST_LATENCY}_count{{{SERVICE}}})",
                    "{{pool}} reporting",
                ),
            ],
            "short",
            decimals=0,
        ),
        panel(
            "Preemptions",
            "Requests preempted for KV space (recomputed later), per second, per pod.",
            [target(f"sum by (pod) ({rate(M.NUM_PREEMPTIONS_TOTAL, WORKERS)})", "{{pod}}")],
            "short",
        ),
        panel(
            "Prefix cache hit rate",
            "Prompt tokens found in the prefix cache over prompt tokens looked up, by role; and"
            " the part loaded from its host tier (spec.runtime.hostKvCacheSize; 0 when off).",
            [
                target(
                    f"sum by (role) ({rate(M.PREFIX_CACHE_HITS_TOTAL, WORKERS)})"
                    f" / sum by (role) ({rate(M.PREFIX_CACHE_QUERIES_TOTAL, WORKERS)})",
                    "{{role}}",
                ),
                target(
                    f"sum by (role) ({rate(M.HOST_KV_CACHE_HITS_TOTAL, WORKERS)})"
                    f" / sum by (role) ({rate(M.PREFIX_CACHE_QUERIES_TOTAL, WORKERS)})",
                    "{{role}} from host memory",
                ),
            ],
            "percentunit",
            max=1,
        ),
        panel(
            "Speculative decoding",
            "Draft tokens verified per second (spec.runtime.numSpeculativeTokens), and the share "
            "the model accepted: each accepted token is a decode step saved. Empty when off.",
            [
                target(f"sum({rate(M.SPEC_DECODE_DRAFT_TOKENS_TOTAL, WORKERS)})", "drafted/s"),
                target(
                    f"sum({rate(M.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL, WORKERS)})"
                    f" / sum({rate(M.SPEC_DECODE_DRAFT_TOKENS_TOTAL, WORKERS)})",
                    "accepted share",
                ),
            ],
            "short",
        ),
        row("Prefill to decode hand-off"),
        panel(
            "Hand-off bandwidth",
            "KV bytes pulled per second by each decode worker, and prompts prefilled remotely "
            "or locally per second.",
            [
                target(f"sum by (pod) ({rate(M.KV_TRANSFER_BYTES_TOTAL, WORKERS)})", "{{pod}}"),
                target(f"sum by (where) ({rate(M.PREFILLS_TOTAL, WORKERS)})", "prefills {{where}}"),
            ],
            "Bps",
            right=("B", "ops"),
        ),
        panel(
            "Hand-off failures",
            "Hand-offs that fell back to a local prefill or a recompute, per second, by reason; "
            "and KV leases that expired unpulled.",
            [
                target(
                    f"sum by (reason) ({rate(M.KV_TRANSFER_FAILURES_TOTAL, WORKERS)})", "{{reason}}"
                ),
                target(f"sum({rate(M.KV_LEASE_EXPIRIES_TOTAL, WORKERS)})", "lease expiries"),
            ],
            "short",
        ),
    ]


def layout(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ids, and grid positions: rows full width, panels two to a line."""
    out, y, x = [], 0, 0
    for i, item in enumerate(items, start=1):
        if item["type"] == "row":
            y += 0 if x == 0 else 8
            item = {**item, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
            y, x = y + 1, 0
        else:
            item = {**item, "gridPos": {"h": 8, "w": 12, "x": x, "y": y}}
            y, x = (y + 8, 0) if x == 12 else (y, 12)
        for j, t in enumerate(item.get("targets", [])):
            t["refId"] = chr(ord("A") + j)
        out.append({"id": i, **item})
    return out


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "includeAll": False,
        "multi": False,
    }


def templating() -> list[dict[str, Any]]:
    router_series = f'{M.E2E_REQUEST_LATENCY}_count{{role="{ROUTER_ROLE}"'
    constants = [
        {"name": name, "type": "constant", "query": value, "hide": 2}
        for name, value in PLACEHOLDERS.items()
    ]
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
        variable("namespace", "Namespace", f"label_values({router_series}}}, namespace)"),
        variable(
            "inferenceservice",
            "InferenceService",
            f'label_values({router_series}, namespace="$namespace"}}, inferenceservice)',
        ),
        *constants,
    ]


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": TITLE,
        "description": "One InferenceService: latency against its SLOs, traffic, capacity and "
        "the KV hand-off (docs/observability.md).",
        "tags": ["phasefleet", "llm"],
        "editable": True,
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": templating()},
        "panels": layout(panels()),
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=CHART_COPY)
    args = parser.parse_args()
    args.output.write_text(dashboard_json())


if __name__ == "__main__":
    main()
