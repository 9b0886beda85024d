"""One run pod's life, as the kubelet lives it: its images "pulled" (images.py), its containers
planned (env, volumes, paths, memory limit, termination-message file); its init containers run
one at a time, each to success (a failed one restarts with back-off, unless restartPolicy is
Never), before the others start, are probed and restarted; its status written through
pods/status when it changes; on deletion its containers stopped within the grace period, then
the pod object deleted."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from e2e.harness.container import BACKOFF_CAP_SECONDS, Container, now_rfc3339
from e2e.harness.images import back_off_message, pull_error
from e2e.harness.kubeapi import MERGE_PATCH, ApiError, KubeApi
from e2e.harness.memcg import memory_limit
from e2e.harness.podnet import is_local, not_local_message
from e2e.harness.podspec import ContainerConfigError, container_env, launch_plan
from e2e.harness.volumes import lookup_key, path_map, refresh_objects
from phasefleet.termination import TERMINATION_LOG_ENV

if TYPE_CHECKING:
    from e2e.harness.podrunner import PodRunner

TICK_SECONDS = 0.2  # between a pod's container checks
# between looks at the pod's Secret and ConfigMap volumes (a kubelet's sync is about a minute;
# shorter here, so that a test of a change does not wait that long)
VOLUME_SYNC_SECONDS = 2.0
CONFIG_RETRY_SECONDS = 2.0  # a CreateContainerConfigError is retried this often
ERR_IMAGE_PULL_SECONDS = 1.0  # a failed pull shows as ErrImagePull this long, then back-off

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
        self.inits: list[Container] = []  # initContainers, in order
        self.waiting: dict[str, dict[str, str]] = {}  # before the containers start: why not
        self.pulls = 0  # failed pull attempts, for the back-off
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

    @property
    def ending(self) -> bool:
        return self.deleting or self.gone.is_set() or self.runner.stopping.is_set()

    def _wait(self, seconds: float) -> None:
        """Sleeps up to `seconds`, less if the pod is deleted or the runner stops."""
        deadline = time.monotonic() + seconds
        while not self.ending and time.monotonic() < deadline:
            time.sleep(TICK_SECONDS)

    def _live(self) -> None:
        while not self.containers:
            if self.ending:
                break
            if self._pull_failed():
                continue
            try:
                self.inits, self.containers = self._plan()
                self.waiting = {}
            except ContainerConfigError as exc:
                reason = {"reason": "CreateContainerConfigError", "message": str(exc)}
                self.waiting = {c["name"]: reason for c in self._specs()}
                self._report()
                time.sleep(CONFIG_RETRY_SECONDS)
        for init in self.inits:
            while not (self.ending or init.done):
                init.step(terminating=False)
                self._report()
                time.sleep(TICK_SECONDS)
            if (init.last_terminated or {}).get("exitCode") != 0:
                break  # stopping, or failed under restartPolicy Never: the rest never start
        synced = time.monotonic()
        while not self.ending:
            if self.initialized:
                for container in self.containers:
                    container.step(terminating=False)
            self._report()
            if time.monotonic() - synced >= VOLUME_SYNC_SECONDS:
                synced = time.monotonic()
                refresh_objects(self.runner.api, self.pod, self.folder / "volumes")
            time.sleep(TICK_SECONDS)
        if self.runner.stopping.is_set():
            return  # the runner stops every pod itself
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        self.stop_all(grace=0 if self.gone.is_set() else grace)
        if not self.gone.is_set():
            self._report()
            delete_now(self.runner.api, self.pod)

    def _specs(self) -> list[dict[str, Any]]:
        spec = self.pod["spec"]
        return [*(spec.get("initContainers") or []), *spec["containers"]]

    @property
    def initialized(self) -> bool:
        """Every init container has run to success."""
        return all(i.done and (i.last_terminated or {}).get("exitCode") == 0 for i in self.inits)

    def _pull_failed(self) -> bool:
        """One pull of every image; a failure is reported as ErrImagePull, then as
        ImagePullBackOff while the kubelet's back-off (10 s doubling, to 300 s) runs."""
        errors = {
            c["name"]: (c.get("image", ""), error)
            for c in self._specs()
            if (error := pull_error(c.get("image", ""))) is not None
        }
        if not errors:
            return False
        self.waiting = {
            name: {"reason": "ErrImagePull", "message": error}
            for name, (_, error) in errors.items()
        }
        self._report()
        self._wait(ERR_IMAGE_PULL_SECONDS)
        self.waiting = {
            name: {"reason": "ImagePullBackOff", "message": back_off_message(image, error)}
            for name, (image, error) in errors.items()
        }
        self._report()
        self._wait(min(self.runner.backoff_base * 2**self.pulls, BACKOFF_CAP_SECONDS))
        self.pulls += 1
        return True

    def stop_all(self, grace: float | None) -> None:
        def stop(container: Container) -> None:
            container.stop(grace)
            container.release()

        threads = [threading.Thread(target=stop, args=(c,)) for c in self.inits + self.containers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _plan(self) -> tuple[list[Container], list[Container]]:
        """(init containers, containers), planned; raises ContainerConfigError."""
        pod, spec = self.pod, self.pod["spec"]
        if not is_local(pod["status"]["podIP"]):
            raise ContainerConfigError(not_local_message(pod["status"]["podIP"]))
        # An init container runs until it succeeds, or once under restartPolicy Never.
        init_policy = "Never" if spec.get("restartPolicy") == "Never" else "OnFailure"
        inits = [self._container(item, init_policy) for item in spec.get("initContainers") or []]
        policy = spec.get("restartPolicy", "Always")
        return inits, [self._container(item, policy) for item in spec["containers"]]

    def _container(self, item: dict[str, Any], restart_policy: str) -> Container:
        api, pod = self.runner.api, self.pod
        namespace, spec = pod["metadata"]["namespace"], pod["spec"]
        env = container_env(
            pod, item, lambda kind, name, key: lookup_key(api, namespace, kind, name, key)
        )
        paths = path_map(api, pod, item, self.folder / "volumes", self.runner.image_root.resolve())
        plan = launch_plan(
            pod,
            item,
            env,
            paths,
            self.runner.python,
            self.runner.base_env(pod),
            self.runner.max_probe_period,
        )
        # The kubelet mounts a fresh file at terminationMessagePath; here the program is told
        # where it is (phasefleet.termination reads this env).
        message_path = self.folder / f"{item['name']}.termination-log"
        plan = dataclasses.replace(plan, env={**plan.env, TERMINATION_LOG_ENV: str(message_path)})
        try:
            limit = memory_limit(item)
        except ValueError as exc:
            raise ContainerConfigError(f"container {item['name']}: {exc}") from exc
        return Container(
            plan=plan,
            host=pod["status"]["podIP"],
            log_path=self.folder / f"{item['name']}.log",
            pid_path=self.folder / f"{item['name']}.pid",
            restart_policy=restart_policy,
            grace_seconds=float(spec.get("terminationGracePeriodSeconds", 30)),
            backoff_base=self.runner.backoff_base,
            message_path=message_path,
            fallback_to_logs=item.get("terminationMessagePolicy") == "FallbackToLogsOnError",
            memory_limit=limit,
            cgroup_name=f"phasefleet-pod-{pod['metadata']['uid']}-{item['name']}",
        )

    def _report(self) -> None:
        """Writes status through the status subresource when it changed."""
        spec = self.pod["spec"]
        images = {c["name"]: c.get("image", "") for c in self._specs()}

        def waiting(name: str, default: str) -> dict[str, Any]:
            return {
                "name": name,
                "image": images[name],
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {"waiting": self.waiting.get(name, {"reason": default})},
            }

        names = [c["name"] for c in spec["containers"]]
        init_names = [c["name"] for c in spec.get("initContainers") or []]
        if not self.containers:
            statuses = [waiting(name, "ContainerCreating") for name in names]
            init_statuses = [waiting(name, "PodInitializing") for name in init_names]
        else:
            init_statuses = [i.status(images[i.plan.name]) for i in self.inits]
            if self.initialized:
                statuses = [c.status(images[c.plan.name]) for c in self.containers]
            else:
                statuses = [waiting(name, "PodInitializing") for name in names]
        ready = bool(statuses) and all(s["ready"] for s in statuses)
        unready = [s["name"] for s in statuses if not s["ready"]]
        phase = "Running" if any("running" in s["state"] for s in statuses) else "Pending"
        if statuses and all("terminated" in s["state"] for s in statuses):
            codes = [s["state"]["terminated"]["exitCode"] for s in statuses]
            phase = "Succeeded" if not any(codes) else "Failed"
        if any(i.done and (i.last_terminated or {}).get("exitCode") for i in self.inits):
            phase = "Failed"  # an init container failed under restartPolicy Never
        key = (statuses_key(init_statuses + statuses), phase)
        if key == self.last_status:
            return
        message = f"containers with unready status: [{' '.join(unready)}]"
        body: dict[str, Any] = {
            "status": {
                "phase": phase,
                "conditions": conditions(self.pod, ready, message),
                "containerStatuses": statuses,
            }
        }
        if init_statuses:
            body["status"]["initContainerStatuses"] = init_statuses
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
