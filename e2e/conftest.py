"""Fixtures for end-to-end tests on a real control plane (see e2e/harness/)."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.controlplane import ControlPlane, tools_bin_dir
from e2e.harness.phasefleet_operator import Operator, install_chart, service_account_kubeconfig
from e2e.harness.podrunner import RUN_LABEL, RUN_VALUE
from e2e.harness.prometheus import Prometheus

_started: list[ControlPlane] = []


@pytest.fixture(scope="session")
def cluster() -> Iterator[ControlPlane]:
    workdir = Path(tempfile.mkdtemp(prefix="phasefleet-e2e-"))
    plane = ControlPlane(workdir=workdir, bin_dir=tools_bin_dir())
    _started.append(plane)
    try:
        plane.start()
        yield plane
    finally:
        plane.destroy()
        _started.remove(plane)


@pytest.fixture
def namespace(cluster: ControlPlane) -> Iterator[str]:
    """A fresh namespace, with its `default` ServiceAccount, deleted after the test."""
    name = f"e2e-{secrets.token_hex(4)}"
    cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 30
    while cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in {name}")
        time.sleep(0.2)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def run_namespace(cluster: ControlPlane, namespace: str) -> str:
    """A fresh namespace whose pods the pod runner runs as local processes."""
    cluster.kubectl("label", "namespace", namespace, f"{RUN_LABEL}={RUN_VALUE}")
    return namespace


@pytest.fixture(scope="session")
def image_model(cluster: ControlPlane) -> str:
    """The tiny model "baked into the image" at /models/tiny-llama (the examples' path):
    written under the cluster's image root, where the pod runner maps that path."""
    from phasefleet.engine.tiny import make_tiny

    make_tiny(cluster.image_root / "models" / "tiny-llama", arch="llama", seed=0)
    return "/models/tiny-llama"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama for tests that start worker processes themselves (no cluster)."""
    from phasefleet.engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama", seed=0)


@pytest.fixture
def start_prometheus() -> Iterator[Callable[[list[dict[str, Any]]], Prometheus]]:
    """Starts real Prometheus servers with the given scrape configs; stops them after."""
    servers: list[Prometheus] = []

    def start(scrape_configs: list[dict[str, Any]]) -> Prometheus:
        server = Prometheus(
            workdir=Path(tempfile.mkdtemp(prefix="phasefleet-prom-")),
            scrape_configs=scrape_configs,
        )
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Attaches the tail of every component's log to a failed test's report."""
    report = yield
    if report.failed and _started:
        for name, tail in _started[0].log_tails(lines=30).items():
            report.sections.append((f"{name} log (last 30 lines)", tail))
        for path in sorted(_started[0].pods_dir.glob("*/*.log")):
            tail = "\n".join(path.read_text(errors="replace").splitlines()[-20:])
            report.sections.append((f"pod {path.parent.name} {path.stem} (last 20 lines)", tail))
    return report


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane) -> Iterator[Operator]:
    """The operator from the chart's RBAC, run with its ServiceAccount's token (per module)."""
    install_chart(cluster)
    workdir = Path(tempfile.mkdtemp(prefix="phasefleet-operator-"))
    kubeconfig = service_account_kubeconfig(cluster, workdir / "kubeconfig")
    op = Operator(cluster, kubeconfig, workdir)
    op.start()
    yield op
    op.stop()
