"""`make cluster-up` / `make cluster-down` / `make demo`: a control plane for people, left
running between commands. Its state (kubeconfig, logs, pids, pods) lives in .cluster/ at the
repository root.

    python -m e2e.harness.cli up      start, print the KUBECONFIG line to use
    python -m e2e.harness.cli demo    up, plus the chart, the operator and the tiny example
                                      served for real; prints the router's URL
    python -m e2e.harness.cli down    stop every component and pod, remove .cluster/
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from e2e.harness.controlplane import ControlPlane, tools_bin_dir
from e2e.harness.memcg import remove_cgroup, stray_cgroups
from e2e.harness.podnet import release_block
from e2e.harness.podrunner import RUN_LABEL, RUN_VALUE, stray_process_groups
from e2e.harness.process import process_group_alive, stop_process_group
from e2e.harness.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
STATE_DIR = ROOT / ".cluster"
STATE_FILE = STATE_DIR / "state.json"
DEMO_NAMESPACE = "demo"
DEMO_EXAMPLE = ROOT / "examples" / "tiny-aggregated.yaml"


def _start() -> ControlPlane | None:
    if STATE_FILE.exists():
        print(f"a cluster is already up (state in {STATE_DIR}); run `make cluster-down` first")
        return None
    started = time.monotonic()
    cluster = ControlPlane(workdir=STATE_DIR, bin_dir=tools_bin_dir())
    cluster.start()
    _save(cluster.pids(), cluster.server)
    print(f"control plane ready in {time.monotonic() - started:.1f}s at {cluster.server}")
    print(f"logs: {cluster.logs_dir}; pods' logs: {cluster.pods_dir}")
    return cluster


def _save(pids: list[int], server: str) -> None:
    STATE_FILE.write_text(json.dumps({"pids": pids, "server": server}))


def _export_line(cluster: ControlPlane) -> str:
    return f"export KUBECONFIG={cluster.kubeconfig} PATH={cluster.bin_dir}:$PATH"


def up() -> int:
    cluster = _start()
    if cluster is None:
        return 1
    print(_export_line(cluster))
    return 0


def demo() -> int:
    """The operator on the control plane with the tiny aggregated example really serving."""
    from e2e.harness.phasefleet_operator import Operator, install_chart, service_account_kubeconfig
    from phasefleet.api.contract import ROUTER_PORT
    from phasefleet.engine.tiny import make_tiny

    cluster = _start()
    if cluster is None:
        return 1
    make_tiny(cluster.image_root / "models" / "tiny-llama", arch="llama", seed=0)
    install_chart(cluster)
    kubeconfig = service_account_kubeconfig(cluster, STATE_DIR / "operator-kubeconfig")
    operator = Operator(cluster, kubeconfig, cluster.logs_dir)
    operator.start()
    _save([*cluster.pids(), *([operator.component.pid] if operator.component.pid else [])],
          cluster.server)  # fmt: skip
    cluster.kubectl("create", "namespace", DEMO_NAMESPACE)
    cluster.kubectl("label", "namespace", DEMO_NAMESPACE, f"{RUN_LABEL}={RUN_VALUE}")
    wait_for(
        lambda: (
            cluster.kubectl("get", "sa", "default", "-n", DEMO_NAMESPACE, check=False).returncode
            == 0
        ),
        30,
        "the demo namespace's default ServiceAccount",
    )
    cluster.kubectl("apply", "-n", DEMO_NAMESPACE, "-f", str(DEMO_EXAMPLE))
    name = cluster.get_json("-f", str(DEMO_EXAMPLE), "-n", DEMO_NAMESPACE)["metadata"]["name"]
    print(f"waiting for InferenceService {DEMO_NAMESPACE}/{name} to be Ready ...")
    wait_for(
        lambda: cluster.kubectl(
            "wait", f"inferenceservice/{name}", "-n", DEMO_NAMESPACE,
            "--for=condition=Ready", "--timeout=5s", check=False,
        ).returncode == 0,
        300,
        f"InferenceService {name} Ready",
    )  # fmt: skip
    pods = cluster.get_json(
        "pods", "-n", DEMO_NAMESPACE, "-l", f"phasefleet.dev/inferenceservice={name}"
    )
    (router,) = [
        p for p in pods["items"] if p["metadata"]["labels"]["phasefleet.dev/role"] == "router"
    ]
    url = f"http://{router['status']['podIP']}:{ROUTER_PORT}"
    print(_export_line(cluster))
    print(f"kubectl get isvc,pods -n {DEMO_NAMESPACE} -o wide   # the operator's work")
    print(f"router of {DEMO_NAMESPACE}/{name}: {url}/v1 (a pod IP, local to this machine)")
    print(
        f"curl {url}/v1/completions -H 'content-type: application/json' "
        """-d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8}'"""
    )
    print("make demo-down stops everything")
    return 0


def down() -> int:
    if not STATE_DIR.exists():
        print("no cluster is up")
        return 0
    pids = json.loads(STATE_FILE.read_text())["pids"] if STATE_FILE.exists() else []
    for pid in reversed(pids):  # the pod runner first: it stops the pods it runs
        stop_process_group(pid)
    for group in stray_process_groups(STATE_DIR / "pods"):
        stop_process_group(group, grace_seconds=5)
    for cgroup in stray_cgroups(STATE_DIR / "pods"):
        remove_cgroup(cgroup)
    leftover = [pid for pid in pids if process_group_alive(pid)]
    if leftover:
        print(f"processes still running: {leftover}", file=sys.stderr)
        return 1
    shutil.rmtree(STATE_DIR)
    release_block(STATE_DIR)
    print("control plane stopped and removed")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.harness.cli")
    parser.add_argument("action", choices=["up", "demo", "down"])
    args = parser.parse_args()
    return {"up": up, "demo": demo, "down": down}[args.action]()


if __name__ == "__main__":
    sys.exit(main())
