"""`phasefleet operator` and `phasefleet crd` argument handling (no kopf started)."""

from __future__ import annotations

import argparse
import sys

import pytest

from phasefleet.operator import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_namespaces_from_flags_then_env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(cli.NAMESPACES_ENV, "a, b,")
    assert cli.watched_namespaces(parse()) == ["a", "b"]
    assert cli.watched_namespaces(parse("-n", "x", "--namespace", "y")) == ["x", "y"]
    monkeypatch.delenv(cli.NAMESPACES_ENV)
    assert cli.watched_namespaces(parse()) == []


def test_cli_modules_do_not_import_kopf_or_kubernetes_at_import_time():
    import importlib

    for name in ("phasefleet.operator.cli", "phasefleet.api.cli"):
        sys.modules.pop(name, None)
        before = {m for m in sys.modules if m.startswith(("kopf", "kubernetes"))}
        importlib.import_module(name)
        after = {m for m in sys.modules if m.startswith(("kopf", "kubernetes"))}
        assert after == before, name
