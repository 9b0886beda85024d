"""`spec.model.cache.pvc` on a real control plane: the operator creates the service's claim
(bound here to a static hostPath PersistentVolume), three worker pods (run by the pod runner as
processes) each start the `fetch-model` init container at once, one downloads the gated
repository from a local Hub (tests/server/hub_server.py) while the others wait on the cache's
lock, and every file is downloaded once, not once per pod. Every worker serves, reading the
cache read-only (the pod runner mounts readOnly volumes read-only) and offline, without the
token; the CPU workers keep the linear plans they timed in the cache (a read-write subPath),
and a pod added later asks the Hub nothing and times no linear."""

from __future__ import annotations

import json
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e.harness.controlplane import ControlPlane
from e2e.harness.phasefleet_operator import Operator, get, is_ready
from e2e.harness.podrunner import RUN_LABEL, RUN_VALUE
from e2e.harness.wait import wait_for
from phasefleet.api.contract import WORKER_PORT
from tests.server.hub_server import FakeHub, FakeRepo, read_folder

NAME = "cached"
REPO = "org/tiny-cached"
TOKEN = "hf_e2e_cache"
STORAGE_CLASS = "e2e-model-cache"
REPLICAS = 3


@dataclass
class Fleet:
    namespace: str
    hub: FakeHub
    hub_requests: int  # requests the Hub had seen once the service was Ready
    folder: Path  # the claim's volume on this machine

    @property
    def plans(self) -> Path:
        return self.folder / "cpu-linear-plans" / "plans.json"


def manifest(hub_url: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {
                "hf": {"repoId": REPO, "revision": "v1", "tokenSecret": {"name": "hf-token"}},
                "cache": {"pvc": {"size": "1Gi", "storageClassName": STORAGE_CLASS}},
                "servedName": "tiny",
                "maxModelLen": 512,
                "dtype": "float32",
            },
            "mode": "aggregated",
            "worker": {"replicas": replicas, "maxNumSeqs": 4},
            "runtime": {
                "env": [
                    {"name": "HF_ENDPOINT", "value": hub_url},
                    # The Hub holds the first download in flight until every pod has arrived.
                    {"name": "HF_HUB_DOWNLOAD_TIMEOUT", "value": "120"},
                ]
            },
        },
    }


def cache_volume(namespace: str, folder: Path) -> dict[str, Any]:
    """A static PersistentVolume the claim the operator creates binds to."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-model-cache"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": STORAGE_CLASS,
            "hostPath": {"path": str(folder)},
            "claimRef": {"namespace": namespace, "name": f"{NAME}-model-cache"},
            "persistentVolumeReclaimPolicy": "Retain",
        },
    }


def worker_pods(cluster: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    found = get(cluster, "pods", "-n", namespace, "-l", "phasefleet.dev/role=worker")
    return list((found or {}).get("items") or [])


def fetching(pod: dict[str, Any]) -> bool:
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    return any(s["name"] == "fetch-model" and "running" in s["state"] for s in statuses)


def blob_requested(hub: FakeHub) -> bool:
    return any(path.startswith("/cdn/") for path in hub.gets())


@pytest.fixture(scope="module")
def fleet(cluster: ControlPlane, operator: Operator, image_model: str) -> Iterator[Fleet]:
    namespace = f"e2e-cache-{secrets.token_hex(4)}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("label", "namespace", namespace, f"{RUN_LABEL}={RUN_VALUE}")
    folder = Path(tempfile.mkdtemp(prefix="phasefleet-model-cache-"))
    volume = cache_volume(namespace, folder)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(volume))
    files = read_folder(cluster.image_root / image_model.lstrip("/"))
    repo = FakeRepo({"main": files, "v1": files}, gated=True, allowed_tokens={TOKEN})
    with FakeHub({REPO: repo}, tokens={TOKEN}) as hub:
        try:
            wait_for(lambda: get(cluster, "sa", "default", "-n", namespace), 30, "default account")
            cluster.kubectl(
                "create", "secret", "generic", "hf-token", f"--from-literal=token={TOKEN}",
                "-n", namespace,
            )  # fmt: skip
            hub.gate.clear()
            service = json.dumps(manifest(hub.url, REPLICAS))
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=service)
            wait_for(lambda: blob_requested(hub), 180, "the first pod to fetch the weights")
            wait_for(
                lambda: sum(fetching(p) for p in worker_pods(cluster, namespace)) == REPLICAS,
                120,
                f"{REPLICAS} fetch-model init containers running at once",
            )
            time.sleep(1)  # the last to arrive reaches the lock
            hub.gate.set()
            try:
                wait_for(lambda: is_ready(cluster, namespace, NAME), 300, f"{NAME} Ready")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}\noperator log:\n{operator.log()[-3000:]}") from None
            yield Fleet(namespace, hub, len(hub.requests), folder)
        finally:
            hub.gate.set()
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
            cluster.kubectl("delete", "pv", volume["metadata"]["name"], "--wait=false", check=False)


def test_pods_starting_together_download_the_model_once_and_all_serve(
    cluster: ControlPlane, fleet: Fleet
) -> None:
    downloads = fleet.hub.downloads()
    assert "model.safetensors" in downloads and "config.json" in downloads
    assert set(downloads.values()) == {1}, downloads  # each file once, not once per pod
    infos = [r for r in fleet.hub.requests if r.path.startswith("/api/models/")]
    assert [r.path for r in infos] == [f"/api/models/{REPO}/revision/v1"]

    pods = worker_pods(cluster, fleet.namespace)
    assert len(pods) == REPLICAS
    logs = [cluster.pod_log(fleet.namespace, p["metadata"]["name"], "fetch-model") for p in pods]
    assert sum("downloaded by this pod" in log for log in logs) == 1, logs
    assert sum("nothing to download" in log for log in logs) == REPLICAS - 1, logs
    answers = set()
    for pod in pods:
        client = openai.OpenAI(
            base_url=f"http://{pod['status']['podIP']}:{WORKER_PORT}/v1",
            api_key="unused",
            max_retries=0,
        )
        done = client.completions.create(
            model="tiny", prompt="Hello, my name is", max_tokens=8, temperature=0
        )
        answers.add(done.choices[0].text)
    assert len(answers) == 1  # the same weights in every pod

    claim = get(cluster, "pvc", f"{NAME}-model-cache", "-n", fleet.namespace)
    (ref,) = claim["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"]) == ("InferenceService", NAME)
    assert claim["status"]["phase"] == "Bound"
    # The CPU workers kept the linear plans they timed in the cache, for the pods after them.
    assert json.loads(fleet.plans.read_text())


def test_workers_read_the_cache_read_only_and_never_see_the_token(
    cluster: ControlPlane, fleet: Fleet
) -> None:
    for pod in worker_pods(cluster, fleet.namespace):
        (engine,) = pod["status"]["containerStatuses"]
        pid = int(engine["containerID"].removeprefix("local://"))
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {item.split(b"=", 1)[0].decode() for item in environ if b"=" in item}
        assert "HF_TOKEN" not in names and "HF_HUB_OFFLINE" in names
        log = cluster.pod_log(fleet.namespace, pod["metadata"]["name"], "engine")
        assert "found in the cache" in log and "(offline, no network call)" in log
        assert TOKEN not in log
        fetch_log = cluster.pod_log(fleet.namespace, pod["metadata"]["name"], "fetch-model")
        assert TOKEN not in fetch_log


def test_pods_starting_together_time_each_linear_shape_once(
    cluster: ControlPlane, fleet: Fleet
) -> None:
    timed, shapes = [], set()
    for pod in worker_pods(cluster, fleet.namespace):
        log = cluster.pod_log(fleet.namespace, pod["metadata"]["name"], "engine")
        found = re.search(r"; (\d+) of (\d+) shapes timed", log)
        assert found, log[-2000:]
        timed.append(int(found[1]))
        shapes.add(int(found[2]))
    (count,) = shapes
    assert len(timed) == REPLICAS and sum(timed) == count, timed  # the others waited and read


def test_a_pod_added_later_downloads_nothing_and_times_no_linear(
    cluster: ControlPlane, fleet: Fleet
) -> None:
    before = {p["metadata"]["name"] for p in worker_pods(cluster, fleet.namespace)}
    plans = fleet.plans.read_bytes(), fleet.plans.stat().st_mtime_ns
    patch = {"spec": {"worker": {"replicas": REPLICAS + 1}}}
    cluster.kubectl(
        "patch", "inferenceservice", NAME, "-n", fleet.namespace, "--type=merge",
        "-p", json.dumps(patch),
    )  # fmt: skip

    def ready_newcomer() -> str | None:
        for pod in worker_pods(cluster, fleet.namespace):
            name = pod["metadata"]["name"]
            ready = [c for c in (pod.get("status") or {}).get("conditions") or []]
            if name not in before and any(
                c["type"] == "Ready" and c["status"] == "True" for c in ready
            ):
                return str(name)
        return None

    newcomer = wait_for(ready_newcomer, 180, "the fourth worker Ready")
    assert len(fleet.hub.requests) == fleet.hub_requests  # not even the repository's info
    log = cluster.pod_log(fleet.namespace, newcomer, "fetch-model")
    assert "nothing to download" in log and "waiting for the model cache lock" not in log
    engine_log = cluster.pod_log(fleet.namespace, newcomer, "engine")
    assert re.search(r"; 0 of \d+ shapes timed", engine_log), engine_log[-2000:]
    assert (fleet.plans.read_bytes(), fleet.plans.stat().st_mtime_ns) == plans  # read, not written
