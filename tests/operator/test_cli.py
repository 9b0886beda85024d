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


def test_prometheus_url_from_flag_then_env_and_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setenv(cli.PROMETHEUS_ENV, "http://prometheus.monitoring:9090")
    assert parse().prometheus_url == "http://prometheus.monitoring:9090"
    assert parse("--prometheus-url", "https://p").prometheus_url == "https://p"
    monkeypatch.delenv(cli.PROMETHEUS_ENV)
    assert cli.check_prometheus_url(parse().prometheus_url) is None  # scrape the pods
    assert cli.run(parse("--prometheus-url", "prometheus:9090")) == 2
    err = capsys.readouterr().err
    assert "must start with http:// or https://" in err and "prometheus.url" in err


def test_cli_modules_do_not_import_kopf_or_kubernetes_at_import_time():
    import importlib

    for name in ("phasefleet.operator.cli", "phasefleet.api.cli"):
        sys.modules.pop(name, None)
        before = {m for m in sys.modules if m.startswith(("kopf", "kubernetes"))}
        importlib.import_module(name)
        after = {m for m in sys.modules if m.startswith(("kopf", "kubernetes"))}
        assert after == before, name
