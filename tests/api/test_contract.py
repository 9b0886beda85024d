"""The operator/runtime contract: one definition, used by the operator and the worker alike."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

from phasefleet.api import contract
from phasefleet.api.spec import Role
from phasefleet.operator.kube import RESOURCES
from tests.autoscale.exposition_server import IDLE


def test_contract_imports_without_torch_kopf_or_kubernetes():
    code = (
        "import sys, phasefleet.api.contract\n"
        "heavy = [m for m in ('torch', 'kopf', 'kubernetes', 'transformers') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_pool_role_maps_to_an_engine_role():
    assert set(contract.POOL_ENGINE_ROLE) == {role.value for role in Role}
    assert contract.POOL_ENGINE_ROLE[Role.WORKER.value] is contract.EngineRole.BOTH


def test_child_kinds_have_rest_paths():
    for child in contract.CHILD_KINDS:
        prefix, plural = RESOURCES[child.kind]
        assert plural == child.plural
        assert prefix.endswith(child.api_version)
    groups = {child.kind: child.group for child in contract.CHILD_KINDS}
    assert groups["Deployment"] == "apps" and groups["Service"] == ""
    assert groups["Role"] == "rbac.authorization.k8s.io"


def test_router_metrics_expose_the_held_gauge_per_pool():
    from phasefleet.router.metrics import RouterMetrics

    metrics = RouterMetrics("m")
    metrics.set_held("decode", 3)
    text = metrics.render().decode()
    held = contract.Metric.ROUTER_REQUESTS_HELD
    assert f'{held}{{model_name="m",role="router",worker_pool="decode"}} 3.0' in text


def test_worker_metrics_expose_every_contract_name():
    from phasefleet.server.metrics import WorkerMetrics

    startup = {"imports": 3.5, "weights": 1.25}
    role = contract.EngineRole.BOTH.value
    with_slots = replace(IDLE, max_loras=2, running_loras=("sql",), loaded_loras=("doc", "sql"))
    text = WorkerMetrics("m", role, lambda: with_slots, lambda: startup).render().decode()
    names = [
        value
        for attr, value in vars(contract.Metric).items()
        if attr.isupper()
        and attr != "PREFIX"
        and isinstance(value, str)
        and not attr.startswith(("AUTOSCALER_", "ROUTER_"))  # the operator's, the router's
    ]
    assert len(names) == 33
    for name in names:
        series = [line for line in text.splitlines() if line.startswith(name)]
        assert series, name
    startup_line = f'{contract.Metric.WORKER_STARTUP_SECONDS}{{model_name="m",phase="weights",'
    assert f'{startup_line}role="{role}"}} 1.25' in text
    lora = f'{contract.Metric.LORA_REQUESTS_INFO}{{max_lora="2",model_name="m",role="{role}",'
    assert f'{lora}running_lora_adapters="sql",waiting_lora_adapters=""}} 1.0' in text
    loaded = f'{contract.Metric.LORA_ADAPTER_LOADED}{{lora_name="doc",model_name="m",'
    assert f'{loaded}role="{role}"}} 1.0' in text
    without = WorkerMetrics("m", role, lambda: IDLE).render().decode()
    assert contract.Metric.LORA_REQUESTS_INFO not in without
    assert contract.Metric.LORA_ADAPTER_LOADED not in without
    # while the model loads there are no engine stats: the engine's series are left out
    loading = WorkerMetrics("m", contract.EngineRole.BOTH.value, lambda: None).render().decode()
    assert contract.Metric.NUM_REQUESTS_RUNNING not in loading
    assert contract.Metric.TIME_TO_FIRST_TOKEN in loading
