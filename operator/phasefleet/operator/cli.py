"""`phasefleet operator`: run the kopf operator for InferenceServices."""

from __future__ import annotations

import argparse
import os

NAMESPACES_ENV = "PHASEFLEET_WATCH_NAMESPACES"  # comma-separated; empty: every namespace
PROMETHEUS_ENV = "PHASEFLEET_PROMETHEUS_URL"  # the chart's prometheus.url
METRICS_PORT_ENV = "PHASEFLEET_METRICS_PORT"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help=f"namespace to watch (repeatable; default: ${NAMESPACES_ENV}, else all namespaces)",
    )
    parser.add_argument(
        "--liveness",
        default=os.environ.get("PHASEFLEET_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="liveness endpoint URL; empty to disable",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("PHASEFLEET_LOG_LEVEL", "info"),
        choices=("debug", "info", "warning", "error"),
    )
    parser.add_argument(
        "--prometheus-url",
        default=os.environ.get(PROMETHEUS_ENV, ""),
        help=(
            f"Prometheus the autoscaler queries (default: ${PROMETHEUS_ENV}); empty: it scrapes"
            " the pods' /metrics itself"
        ),
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get(METRICS_PORT_ENV) or 0),
        help=(
            "port of the operator's /metrics (the autoscaler's decisions; default:"
            f" ${METRICS_PORT_ENV}, else 0: not served)"
        ),
    )
    parser.add_argument(
        "--peering",
        default=None,
        help="kopf peering object name for several operator replicas (default: standalone)",
    )


def watched_namespaces(args: argparse.Namespace) -> list[str]:
    if args.namespace:
        return list(args.namespace)
    return [ns.strip() for ns in os.environ.get(NAMESPACES_ENV, "").split(",") if ns.strip()]


def check_prometheus_url(url: str) -> str | None:
    """The autoscaler's Prometheus URL, or None (scrape the pods); ValueError names the fix."""
    if not url:
        return None
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"--prometheus-url / ${PROMETHEUS_ENV} (the chart's prometheus.url) must start with"
            f" http:// or https://, got {url!r}"
        )
    return url


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    try:
        prometheus_url = check_prometheus_url(args.prometheus_url)
    except ValueError as exc:
        print(f"phasefleet operator: {exc}", file=sys.stderr)
        return 2

    import kopf

    import phasefleet.operator.autoscaling  # noqa: F401  (registers the autoscaler's daemon)
    import phasefleet.operator.handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.metrics_port:
        from phasefleet.operator.metrics import AUTOSCALER_METRICS

        AUTOSCALER_METRICS.serve(args.metrics_port)
    namespaces = watched_namespaces(args)
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(prometheus_url=prometheus_url),
    )
    return 0
