"""`phasefleet crd`: print the InferenceService CustomResourceDefinition as YAML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output",
        "-o",
        type=Path,
        action="append",
        default=[],
        help="write to this file instead of stdout (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    from phasefleet.api.crd import crd_yaml

    text = crd_yaml()
    if not args.output:
        sys.stdout.write(text)
    for path in args.output:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0
