"""The pod runner: the kubelet of the fake nodes. KWOK gives each bound pod its IP (an address of
this machine, see podnet.py); the runner does the rest.

- In a namespace labelled `e2e.phasefleet.dev/pod-runner=run`, each container's command runs as
  a local process listening on the pod's IP (podspec.py, volumes.py, container.py). The pod is
  Ready only while the containers' readiness probes pass. Deleting the pod runs the preStop
  sleep, SIGTERM, SIGKILL at the end of the grace period, then deletes the pod object (grace 0,
  as the kubelet does once its containers are gone).
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

from e2e.harness.container import Container, now_rfc3339
from e2e.harness.kubeapi import MERGE_PATCH, ApiError, KubeApi
from e2e.harness.podnet import is_local, not_local_message
from e2e.harness.podspec import ContainerConfigError, container_env, launch_plan
from e2e.harness.volumes import lookup_key, path_map

RUN_LABEL = "e2e.phasefleet.dev/pod-runner"  # on a namespace: "run" its pods' containers
RUN_VALUE = "run"
SYNC_SECONDS = 0.5  # between lists of every pod
TICK_SECONDS = 0.2  # between a pod's container checks
CONFIG_RETRY_SECONDS = 2.0  # a CreateContainerConfigError is retried this often

log = logging.getLogger("podrunner")


def pod_path(pod: dict[str, Any]) -> str:
    meta = pod["metadata"]
    return f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"


def conditions(pod: dict[str, Any], ready: bool, message: str) -> list[dict[str, Any]]:
    """The pod's conditions with Ready and ContainersReady set; a transition time moves only
    when the status changes."""
    status = "True" if ready else "False"
    out = [
        c
        for c in pod["status"].get("conditions") or []
        if c["type"] not in ("Ready", "ContainersReady")
    ]
    previous = {c["type"]: c for c in pod["status"].get("conditions") or []}
    for kind in ("ContainersReady", "Ready"):
        old = previous.get(kind, {})
        cond: dict[str, Any] = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": (
                old["lastTransitionTime"] if old.get("status") == status else now_rfc3339()
            ),
        }
        if not ready:
            cond.update(reason="ContainersNotReady", message=message)
        out.append(cond)
    return out


def delete_now(api: KubeApi, pod: dict[str, Any]) -> None:
    """What the kubelet sends once a pod's containers are gone: grace 0, this UID only."""
    body = {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "gracePeriodSeconds": 0,
        "preconditions": {"uid": pod["metadata"]["uid"]},
    }
    try:
        api.delete(pod_path(pod), body)
    except ApiError as exc:
        if exc.status not in (404, 409):
            raise


class PodLife(threading.Thread):
    """One run pod: its containers from start to the deletion of the pod object."""

    def __init__(self, runner: PodRunner, pod: dict[str, Any]):
        meta = pod["metadata"]
        super().__init__(name=f"pod {meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.pod = pod
        self.folder = runner.pods_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        self.containers: list[Container] = []
        self.config_error: str | None = None
        self.gone = threading.Event()  # the pod object vanished (force delete)
        self.last_status: Any = None

    @property
    def deleting(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp"))

    def run(self) -> None:
        try:
            self._live()
        except Exception:
            log.exception("%s failed", self.name)
            self.stop_all(grace=5)

    def _live(self) -> None:
        while not self.containers:
            if self.deleting or self.gone.is_set() or self.runner.stopping.is_set():
                break
            try:
                self.containers = self._plan()
                self.config_error = None
            except ContainerConfigError as exc:
                self.config_error = str(exc)
                self._report()
                time.sleep(CONFIG_RETRY_SECONDS)
        while not (self.deleting or self.gone.is_set() or self.runner.stopping.is_set()):
            for container in self.containers:
                container.step(terminating=False)
            self._report()
            time.sleep(TICK_SECONDS)
        if self.runner.stopping.is_set():
            return  # the runner stops every pod itself
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        self.stop_all(grace=0 if self.gone.is_set() else grace)
        if not self.gone.is_set():
            self._report()
            delete_now(self.runner.api, self.pod)

    def stop_all(self, grace: float | None) -> None:
        threads = [
            threading.Thread(target=container.stop, args=(grace,)) for container in self.containers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _plan(self) -> list[Container]:
        api, pod = self.runner.api, self.pod
        namespace = pod["metadata"]["namespace"]
        spec = pod["spec"]
        if not is_local(pod["status"]["podIP"]):
            raise ContainerConfigError(not_local_message(pod["status"]["podIP"]))
        containers = []
        for item in spec["containers"]:
            env = container_env(
                pod, item, lambda kind, name, key: lookup_key(api, namespace, kind, name, key)
            )
            paths = path_map(
                api, pod, item, self.folder / "volumes", self.runner.image_root.resolve()
            )
            plan = launch_plan(
                pod,
                item,
                env,
                paths,
                self.runner.python,
                self.runner.base_env(pod),
                self.runner.max_probe_period,
            )
            containers.append(
                Container(
                    plan=plan,
                    host=pod["status"]["podIP"],
                    log_path=self.folder / f"{item['name']}.log",
                    pid_path=self.folder / f"{item['name']}.pid",
                    restart_policy=spec.get("restartPolicy", "Always"),
                    grace_seconds=float(spec.get("terminationGracePeriodSeconds", 30)),
                    backoff_base=self.runner.backoff_base,
                )
            )
        return containers

    def _report(self) -> None:
        """Writes status through the status subresource when it changed."""
        images = {c["name"]: c.get("image", "") for c in self.pod["spec"]["containers"]}
        if self.config_error is not None:
            statuses = [
                {
                    "name": name,
                    "image": image,
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 0,
                    "state": {
                        "waiting": {
                            "reason": "CreateContainerConfigError",
                            "message": self.config_error,
                        }
                    },
                }
                for name, image in images.items()
            ]
        else:
            statuses = [c.status(images[c.plan.name]) for c in self.containers]
        ready = bool(statuses) and all(s["ready"] for s in statuses)
        unready = [s["name"] for s in statuses if not s["ready"]]
        phase = "Running" if any("running" in s["state"] for s in statuses) else "Pending"
        if statuses and all("terminated" in s["state"] for s in statuses):
            codes = [s["state"]["terminated"]["exitCode"] for s in statuses]
            phase = "Succeeded" if not any(codes) else "Failed"
        key = (statuses_key(statuses), phase)
        if key == self.last_status:
            return
        message = f"containers with unready status: [{' '.join(unready)}]"
        body = {
            "status": {
                "phase": phase,
                "conditions": conditions(self.pod, ready, message),
                "containerStatuses": statuses,
            }
        }
        try:
            self.pod = self.runner.api.patch(f"{pod_path(self.pod)}/status", body, MERGE_PATCH)
            self.last_status = key
        except ApiError as exc:
            if exc.status != 404:
                log.warning("%s: status not written: %s", self.name, exc)


def statuses_key(statuses: list[dict[str, Any]]) -> str:
    """What a status write would change (not the back-off countdown in a message)."""
    parts = []
    for s in statuses:
        state = dict(s["state"])
        waiting = state.get("waiting")
        if waiting:
            state = {"waiting": {"reason": waiting["reason"]}}
        parts.append(repr((s["name"], s["ready"], s["started"], s["restartCount"], state)))
    return "|".join(parts)


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
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            life = self.lives.get(uid)
            if life is not None:
                life.pod["metadata"] = pod["metadata"]
                continue
            if not (pod.get("status") or {}).get("podIP"):
                if pod["metadata"].get("deletionTimestamp"):
                    delete_now(self.api, pod)  # KWOK never started it
                continue
            if pod["metadata"]["namespace"] in run and not pod["metadata"].get("deletionTimestamp"):
                life = PodLife(self, pod)
                self.lives[uid] = life
                life.start()
            else:
                self.pretend(pod)
        for uid, life in list(self.lives.items()):
            if uid not in seen:
                life.gone.set()
            if not life.is_alive() and uid not in seen:
                del self.lives[uid]

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
