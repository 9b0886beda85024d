"""The `phasefleet` console script: one subcommand per program.

Each subcommand lives in a module with `add_arguments(parser)` and `run(args) -> int`. Those
modules import heavy dependencies (torch, kopf) inside `run`, so `--help` is fast and the
operator image, which has no torch, shares this entry point.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("phasefleet.local.cli", "run a local fleet: router + prefill and decode workers"),
    "worker": ("phasefleet.server.cli", "run one engine worker (the container entrypoint)"),
    "fetch-model": (
        "phasefleet.server.model_cache",
        "download a Hub model into a cache pods share, once (the pods' init container)",
    ),
    "router": ("phasefleet.router.cli", "run the router: the OpenAI front door over the workers"),
    "make-tiny": ("phasefleet.engine.tiny", "write a small random model and tokenizer to a folder"),
    "crd": ("phasefleet.api.cli", "print the InferenceService CustomResourceDefinition"),
    "plan": ("phasefleet.plan.cli", "size a service for a request trace and an SLO"),
    "operator": ("phasefleet.operator.cli", "run the Kubernetes operator (kopf)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phasefleet",
        description="Disaggregated prefill/decode LLM serving on Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
