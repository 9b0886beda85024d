"""`phasefleet operator`: run the kopf operator for InferenceServices."""

from __future__ import annotations

import argparse
import os

NAMESPACES_ENV = "PHASEFLEET_WATCH_NAMESPACES"  # comma-separated; empty: every namespace


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
        "--peering",
        default=None,
        help="kopf peering object name for several operator replicas (default: standalone)",
    )


def watched_namespaces(args: argparse.Namespace) -> list[str]:
    if args.namespace:
        return list(args.namespace)
    return [ns.strip() for ns in os.environ.get(NAMESPACES_ENV, "").split(",") if ns.strip()]


def run(args: argparse.Namespace) -> int:
    import logging

    import kopf

    import phasefleet.operator.handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    namespaces = watched_namespaces(args)
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness or None,
    )
    return 0
