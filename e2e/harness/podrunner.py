"""The pod runner: the kubelet of the fake nodes. KWOK gives each bound pod its IP (an address of
this machine, see podnet.py); the runner does the rest.

- In a namespace labelled `e2e.phasefleet.dev/pod-runner=run`, each container's command runs as
  a local process listening on the pod's IP (podlife.py, podspec.py, volumes.py,
  container.py). The pod is Ready only while the containers' readiness probes pass. Deleting
  the pod runs the preStop sleep, SIGTERM, SIGKILL at the end of the grace period, then deletes
  the pod object (grace 0, as the kubelet does once its containers are gone).
- Elsewhere the runner acts as KWOK's "fast" stages did: Running and Ready at once, deleted at
  once. The other e2e tests' pods (a Llama on a GPU the machine does not have) run nothing.

    python -m e2e.harness.podrunner --kubeconfig K --workdir DIR --image-root ROOT
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from e2e.harness.container import now_rfc3339
from e2e.harness.kubeapi import MERGE_PATCH, ApiError, KubeApi
from e2e.harness.podlife import PodLife, conditions, delete_now, pod_path

RUN_LABEL = "e2e.phasefleet.dev/pod-runner"  # on a namespace: "run" its pods' containers
RUN_VALUE = "run"
SYNC_SECONDS = 0.5  # between lists of every pod

log = logging.getLogger("podrunner")


class PodRunner:
    def __init__(
        self,
        api: KubeApi,
        workdir: Path,
        image_root: Path,
        python: str = sys.executable,
        max_probe_period: float = 1.0,
        backoff_base: float = 10.0,
    ):
        self.api = api
        self.pods_dir = workdir
        self.image_root = image_root
        self.python = python
        self.max_probe_period = max_probe_period  # seconds: probes run at least this often
        self.backoff_base = backoff_base  # seconds before a container's first restart
        self.lives: dict[str, PodLife] = {}
        self.stopping = threading.Event()
        host, port = api.server.removeprefix("https://").rsplit(":", 1)
        self.apiserver = (host, port)

    def base_env(self, pod: dict[str, Any]) -> dict[str, str]:
        """What every container gets besides its own env: the API server (the kubelet's
        KUBERNETES_SERVICE_* point at the `kubernetes` Service; here at the real address,
        as there is no kube-proxy), PATH, PYTHONPATH and the pod's hostname."""
        host, port = self.apiserver
        image = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
        return {
            **image,  # part of "the image": where its Python finds phasefleet
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOSTNAME": pod["metadata"]["name"],
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://{host}:{port}",
        }

    def run_namespaces(self) -> set[str]:
        selector = quote(f"{RUN_LABEL}={RUN_VALUE}")
        items = self.api.get(f"/api/v1/namespaces?labelSelector={selector}")["items"]
        return {item["metadata"]["name"] for item in items}

    def sync(self) -> None:
        """One pass over every pod on a node."""
        run = self.run_namespaces()
        pods = self.api.get("/api/v1/pods?fieldSelector=spec.nodeName%21%3D")["items"]
        seen = set()
        for pod in pods:
            seen.add(pod["metadata"]["uid"])
            try:
                self.sync_pod(pod, pod["metadata"]["namespace"] in run)
            except ApiError as exc:
                meta = pod["metadata"]
                log.warning("pod %s/%s: %s", meta["namespace"], meta["name"], exc)
        for uid, life in list(self.lives.items()):
            if uid not in seen:
                life.gone.set()
            if not life.is_alive() and uid not in seen:
                del self.lives[uid]

    def sync_pod(self, pod: dict[str, Any], run: bool) -> None:
        uid, deleting = pod["metadata"]["uid"], bool(pod["metadata"].get("deletionTimestamp"))
        life = self.lives.get(uid)
        if life is not None:
            life.pod["metadata"] = pod["metadata"]
            if deleting and not life.is_alive():
                delete_now(self.api, pod)  # its thread failed; its containers are stopped
            return
        if not (pod.get("status") or {}).get("podIP"):
            if deleting:
                delete_now(self.api, pod)  # KWOK never started it
            return
        if run and not deleting:
            life = PodLife(self, pod)
            self.lives[uid] = life
            life.start()
        else:
            self.pretend(pod)

    def pretend(self, pod: dict[str, Any]) -> None:
        """A pod whose containers are not run: Ready at once, gone at once when deleted."""
        if pod["metadata"].get("deletionTimestamp"):
            delete_now(self.api, pod)
            return
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod["status"].get("conditions") or []
        ):
            return
        now = now_rfc3339()
        statuses = [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod["spec"]["containers"]
        ]
        body = {
            "status": {
                "phase": "Running",
                "conditions": conditions(pod, True, ""),
                "containerStatuses": statuses,
            }
        }
        try:
            self.api.patch(f"{pod_path(pod)}/status", body, MERGE_PATCH)
        except ApiError as exc:
            if exc.status != 404:
                raise

    def run_forever(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.sync()
            except (ApiError, OSError) as exc:
                log.warning("pod list failed: %s", exc)
            self.stopping.wait(max(SYNC_SECONDS - (time.monotonic() - started), 0))
        self.stop_everything()

    def stop_everything(self, grace: float = 5.0) -> None:
        """The runner is stopping: every container gets SIGTERM, SIGKILL after grace."""
        threads = []
        for life in self.lives.values():
            thread = threading.Thread(target=life.stop_all, args=(grace,))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()


def stray_process_groups(pods_dir: Path) -> list[int]:
    """Process groups a pod's pid file still names (after the runner itself died)."""
    groups = []
    for pid_file in pods_dir.glob("*/*.pid"):
        try:
            groups.append(int(pid_file.read_text()))
        except ValueError:
            continue
    return groups


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.harness.podrunner")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True, help="a folder per pod here")
    parser.add_argument("--image-root", type=Path, required=True, help="the image's files")
    parser.add_argument("--python", default=sys.executable, help="runs `phasefleet`")
    parser.add_argument("--max-probe-period", type=float, default=1.0, help="seconds")
    parser.add_argument("--backoff-base", type=float, default=10.0, help="seconds")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s: %(message)s"
    )
    logging.Formatter.converter = time.gmtime
    runner = PodRunner(
        KubeApi.from_kubeconfig(args.kubeconfig),
        args.workdir,
        args.image_root,
        python=args.python,
        max_probe_period=args.max_probe_period,
        backoff_base=args.backoff_base,
    )
    signal.signal(signal.SIGTERM, lambda *_: runner.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: runner.stopping.set())
    log.info("running pods of namespaces labelled %s=%s", RUN_LABEL, RUN_VALUE)
    runner.run_forever()
    log.info("stopped at %s", datetime.datetime.now(datetime.UTC).isoformat())
    return 0


if __name__ == "__main__":
    sys.exit(main())
