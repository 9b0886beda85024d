"""The pod runner as a kubelet: env and paths resolved, a missing Secret reported and then
picked up, graceful deletion, and a crashing container reported (with its termination
message) and restarted with back-off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from e2e.harness.controlplane import ControlPlane
from e2e.harness.process import process_group_alive
from e2e.harness.wait import wait_for


def pod(name: str, args: list[str], env: list[dict[str, Any]]) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {
                "terminationGracePeriodSeconds": 20,
                "containers": [
                    {
                        "name": "main",
                        "image": "phasefleet/engine:test",
                        "command": ["phasefleet"],
                        "args": args,
                        "env": env,
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}},
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                        "lifecycle": {"preStop": {"sleep": {"seconds": 1}}},
                    }
                ],
                "volumes": [{"name": "tmp", "emptyDir": {}}],
            },
        }
    )


def status(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    found = cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(found.stdout)["status"] if found.returncode == 0 else {}


def container(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    statuses = status(cluster, namespace, name).get("containerStatuses") or [{}]
    return dict(statuses[0])


def test_env_paths_secret_and_graceful_deletion(cluster: ControlPlane, run_namespace: str) -> None:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "DATA", "value": "$(HOME)/data"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "later", "key": "token"}}},
    ]
    args = ["router", "--served-model-name", "m", "--workers", "127.0.0.1:9", "--port", "8000"]
    cluster.kubectl("apply", "-n", run_namespace, "-f", "-", input=pod("r", args, env))

    def waiting_on_secret() -> str | None:
        waiting = container(cluster, run_namespace, "r").get("state", {}).get("waiting", {})
        return (
            waiting.get("message")
            if waiting.get("reason") == "CreateContainerConfigError"
            else None
        )

    assert wait_for(waiting_on_secret, 30, "CreateContainerConfigError") == (
        "secret 'later' has no key 'token' (env TOKEN of container main)"
    )
    cluster.kubectl(
        "create", "secret", "generic", "later", "-n", run_namespace, "--from-literal=token=s3"
    )
    wait_for(lambda: container(cluster, run_namespace, "r").get("ready"), 60, "the pod Ready")

    got = status(cluster, run_namespace, "r")
    ip = got["podIP"]
    pid = int(got["containerStatuses"][0]["containerID"].removeprefix("local://"))
    environ = dict(
        line.split("=", 1)
        for line in Path(f"/proc/{pid}/environ").read_text().split("\0")
        if "=" in line
    )
    (folder,) = cluster.pods_dir.glob(f"{run_namespace}_r_*")
    tmp = folder / "volumes" / "tmp"
    assert environ["HOME"] == str(tmp) and tmp.is_dir()
    assert environ["DATA"] == f"{tmp}/data"
    assert (environ["POD_NAME"], environ["POD_IP"], environ["TOKEN"]) == ("r", ip, "s3")
    assert environ["KUBERNETES_SERVICE_PORT"] == cluster.server.rsplit(":", 1)[1]
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    assert argv[-3:-1] == ["--host", ip]

    cluster.kubectl("delete", "pod", "r", "-n", run_namespace, "--wait=true", timeout=60)
    assert not process_group_alive(pid)
    log = cluster.pod_log(run_namespace, "r", "main")
    assert '"GET /health HTTP/1.1" 200' in log


def test_a_crashing_container_backs_off_and_restarts(
    cluster: ControlPlane, run_namespace: str
) -> None:
    args = ["worker", "--model", "/models/missing", "--served-model-name", "m", "--port", "8000"]
    cluster.kubectl("apply", "-n", run_namespace, "-f", "-", input=pod("crash", args, []))

    def backing_off() -> dict[str, Any] | None:
        got = container(cluster, run_namespace, "crash")
        waiting = got.get("state", {}).get("waiting", {})
        return got if waiting.get("reason") == "CrashLoopBackOff" else None

    first = wait_for(backing_off, 60, "CrashLoopBackOff")
    assert first["lastState"]["terminated"]["exitCode"] == 2
    assert first["lastState"]["terminated"]["reason"] == "Error"
    # The worker's fatal line, from the file the runner gave it as its termination log.
    assert first["lastState"]["terminated"]["message"] == (
        f"model folder {cluster.image_root.resolve()}/models/missing does not exist: put the"
        " model there, or point spec.model (image.path, pvc.path) or --model at a folder with"
        " config.json"
    )
    assert first["ready"] is False and first["restartCount"] == 0
    # The first back-off is 10 s; then it runs, fails again and waits 20 s.
    again = wait_for(
        lambda: (c := backing_off()) and c["restartCount"] == 1 and c, 60, "restartCount 1"
    )
    assert (
        again["lastState"]["terminated"]["finishedAt"]
        >= first["lastState"]["terminated"]["finishedAt"]
    )
    assert "models/missing does not exist" in cluster.pod_log(run_namespace, "crash", "main")
    conditions = {
        c["type"]: c["status"] for c in status(cluster, run_namespace, "crash")["conditions"]
    }
    assert conditions["Ready"] == "False"
