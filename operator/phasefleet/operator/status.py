"""The operator's part of InferenceService status, computed from the child Deployments.

Pure: the caller passes in the live Deployments, the previous status and the time. The
operator owns the Ready, Progressing and Degraded conditions, `pools.*.{replicas,
readyReplicas, desiredReplicas}`, the ready summaries, `scale` and the endpoint; the autoscaler
owns the metrics, its own conditions and `pools.*.lastScale*` (server-side apply keeps them
apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasefleet.api.spec import DEFAULT_IMAGE, InferenceServiceSpec, Role
from phasefleet.api.status import DEGRADED, PROGRESSING, READY
from phasefleet.operator.children import endpoint
from phasefleet.operator.compare import contains
from phasefleet.operator.meta import ROLE_LABEL, ROUTER, Owner, child_name

OWNED_CONDITIONS = (READY, PROGRESSING, DEGRADED)
# The ready/desired summary of each pool, for `kubectl get`'s columns: a service writes those of
# its own pools only, so an aggregated one shows its worker pool once (the others print blank).
SUMMARY_FIELDS = {
    Role.PREFILL.value: "prefillReady",
    Role.DECODE.value: "decodeReady",
    Role.WORKER.value: "workersReady",
}
STUCK_REASONS = {"ProgressDeadlineExceeded", "ReplicaFailure"}
# status.scale, for `kubectl get`: every worker pool at 0, or a pool at minReplicas 0 starting
# its first replica while the router holds requests (blank otherwise).
SCALED_TO_ZERO = "ScaledToZero"
WAKING = "WakingFromZero"
MAX_CAUSE = 300  # characters of an API server or kubelet message quoted in a condition
MAX_LAST_WORDS = 600  # characters of a container's termination message (its end is kept)

# Why a container cannot start (kubelet's waiting reasons), and what the user can do about it.
# CrashLoopBackOff is not here: its cause is the last exit (`_exit_problem`).
POD_FIXES = {
    "CreateContainerConfigError": (
        "create the Secret or ConfigMap it names (spec.model.hf.tokenSecret, spec.runtime.env),"
        " or change the spec"
    ),
    "CreateContainerError": "check spec.runtime.env and spec.runtime.extraArgs",
    "ErrImagePull": "check spec.runtime.image and the node's pull access",
    "ImagePullBackOff": "check spec.runtime.image and the node's pull access",
    "InvalidImageName": "fix spec.runtime.image",
}

PULL_ERROR = "ErrImagePull: "  # where an ImagePullBackOff message quotes the failed pull
# argparse's words, ending a program's log, for flags it does not know: a worker or router
# image of another release than the operator's (or a typo in spec.runtime.extraArgs).
UNKNOWN_FLAGS = "error: unrecognized arguments: "

# The scheduler's reasons (in its "0/3 nodes are available: ..." message), most specific first,
# and the fix for each; {pool} is the pool's field in the spec.
SCHEDULING_FIXES = (
    (
        "Insufficient nvidia.com/gpu",
        "ask for fewer GPUs per pod ({pool}.tensorParallelSize and the nvidia.com/gpu limit in"
        " {pool}.resources: all of a pod's GPUs must be on one node) or fewer replicas, add"
        " nodes with free GPUs, or with autoscaling set a spec.autoscaling.gpuBudget the"
        " cluster holds",
    ),
    ("untolerated taint", "add the nodes' taint to {pool}.tolerations, or free untainted nodes"),
    ("node affinity/selector", "fix {pool}.nodeSelector or {pool}.affinity to match nodes"),
    ("Insufficient", "lower {pool}.resources.requests, or add nodes with room for the pod"),
)
SCHEDULING_FALLBACK = "add nodes the pod fits on, or relax {pool}'s resources and placement"


@dataclass(frozen=True)
class Problem:
    """Why the service cannot work as specified, and what the user should do about it."""

    reason: str  # CamelCase, e.g. ModelVolumeMissing
    message: str  # names the object and the fix


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_CAUSE else text[: MAX_CAUSE - 3] + "..."


def _last_words(text: str) -> str:
    """A termination message on one line; a long one (a log tail) keeps its end."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_LAST_WORDS else "..." + text[3 - MAX_LAST_WORDS :]


def _unschedulable(pod: dict[str, Any], where: str, role: str) -> Problem | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (cond.get("type"), cond.get("status"), cond.get("reason")) != (
            "PodScheduled", "False", "Unschedulable",
        ):  # fmt: skip
            continue
        said = cond.get("message") or "no message"
        fix = next((f for key, f in SCHEDULING_FIXES if key in said), SCHEDULING_FALLBACK)
        return Problem(
            "PodUnschedulable",
            f"{where} cannot be scheduled ({_cut(said)}); {fix.format(pool=f'spec.{role}')}",
        )
    return None


def _exit_problem(container: dict[str, Any], where: str, role: str) -> Problem | None:
    """A container that exited with an error and is not running again past its startup
    probe: its last exit, with the message it left (the termination message) as the cause."""
    state = container.get("state") or {}
    ended = state.get("terminated") or (container.get("lastState") or {}).get("terminated")
    if not ended or container.get("ready") or int(ended.get("exitCode") or 0) == 0:
        return None
    if "running" in state and (container.get("started") or not container.get("restartCount")):
        return None  # running past its startup probe: merely not ready, not failing
    name, code = container.get("name", "?"), ended.get("exitCode")
    said = _last_words(ended.get("message") or "")
    if ended.get("reason") == "OOMKilled":
        return Problem(
            "ContainerFailing",
            f"{where} keeps failing: container {name} was killed for exceeding its memory"
            f" limit (OOMKilled, exit code {code}); raise spec.{role}.resources.limits.memory,"
            " or lower maxModelLen or maxNumSeqs",
        )
    if UNKNOWN_FLAGS in said:
        flags = said.rsplit(UNKNOWN_FLAGS, 1)[1]
        return Problem(
            "ContainerFailing",
            f"{where} keeps failing: container {name} (image {container.get('image', '?')})"
            f" does not know the flags {_cut(flags)}; if spec.runtime.extraArgs has them, fix"
            " or remove them, else the image is of an older release than this operator: set"
            f" spec.runtime.image to one of the operator's release (its default, {DEFAULT_IMAGE})",
        )
    if said:
        return Problem(
            "ContainerFailing",
            f"{where} keeps failing: container {name} exited with code {code} ({said});"
            " change what the message names (kubectl logs --previous has the rest)",
        )
    return Problem(
        "ContainerFailing",
        f"{where} keeps failing: container {name} exited with code {code} and left no message;"
        f" read kubectl logs --previous -c {name} {where.split()[1]} for the error",
    )


def _problem_of(pod: dict[str, Any]) -> Problem | None:
    meta, status = pod["metadata"], pod.get("status") or {}
    role = (meta.get("labels") or {}).get(ROLE_LABEL, "?")
    where = f"Pod {meta['namespace']}/{meta['name']} (pool {role})"
    unscheduled = _unschedulable(pod, where, role)
    if unscheduled is not None:
        return unscheduled
    # Init containers first (the model cache's download): the others wait on them.
    containers = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for container in containers:
        waiting = (container.get("state") or {}).get("waiting") or {}
        fix = POD_FIXES.get(waiting.get("reason", ""))
        if fix is not None:
            reason, said = waiting["reason"], waiting.get("message") or "no message"
            if reason == "ImagePullBackOff" and PULL_ERROR in said:
                # The same failed pull as the ErrImagePull between back-offs, in its words, so
                # the condition (and its event) does not change with every retry.
                reason, said = "ErrImagePull", said.split(PULL_ERROR, 1)[1]
            cause = _cut(f"{reason}: {said}")
            return Problem("PodCannotStart", f"{where} cannot start ({cause}); {fix}")
        exited = _exit_problem(container, where, role)
        if exited is not None:
            return exited
    return None


def pod_problem(pods: list[dict[str, Any]]) -> Problem | None:
    """The first pod that cannot run, as a Problem naming its pool, the pod, the cause and
    the fix: unschedulable (the scheduler's message), a container waiting for something it
    cannot get (a missing Secret: CreateContainerConfigError; an image: ErrImagePull), or a
    container that exited with an error (its termination message). Worker pools come before
    the router, whose pods often fail for the same reason; pods being deleted are skipped.
    """
    alive = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    for pod in sorted(
        alive,
        key=lambda p: (
            (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == ROUTER,
            p["metadata"]["name"],
        ),
    ):
        problem = _problem_of(pod)
        if problem is not None:
            return problem
    return None


def degraded_news(desired: dict[str, Any], previous: dict[str, Any]) -> Problem | None:
    """The Degraded condition `desired` raises or rewords against `previous`: what to post
    once as a Warning event (not again while the same text stands)."""

    def degraded(status: dict[str, Any]) -> dict[str, Any]:
        found = [c for c in status.get("conditions") or [] if c.get("type") == DEGRADED]
        return found[0] if found else {}

    new, old = degraded(desired), degraded(previous)
    if new.get("status") != "True":
        return None
    if old.get("status") == "True" and old.get("message") == new.get("message"):
        return None
    return Problem(str(new.get("reason")), str(new.get("message")))


def _pool(deployment: dict[str, Any] | None) -> dict[str, int]:
    if deployment is None:
        return {"replicas": 0, "readyReplicas": 0, "desiredReplicas": 0}
    status = deployment.get("status") or {}
    return {
        "replicas": int(status.get("replicas") or 0),
        "readyReplicas": int(status.get("readyReplicas") or 0),
        "desiredReplicas": int((deployment.get("spec") or {}).get("replicas") or 0),
    }


def _rolled_out(deployment: dict[str, Any]) -> bool:
    meta, status = deployment["metadata"], deployment.get("status") or {}
    desired = int(deployment["spec"].get("replicas") or 0)
    return (
        int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        and int(status.get("updatedReplicas") or 0) >= desired
        and int(status.get("replicas") or 0) == desired
    )


def pool_ready(deployment: dict[str, Any] | None) -> bool:
    """A Deployment rolled out to its current template with every wanted pod ready."""
    if deployment is None:
        return False
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    return _rolled_out(deployment) and ready >= int(deployment["spec"].get("replicas") or 0)


def _stuck(deployment: dict[str, Any]) -> str | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("reason") in STUCK_REASONS or (
            cond.get("type") == "ReplicaFailure" and cond.get("status") == "True"
        ):
            return f"{cond.get('reason')}: {cond.get('message', '')}".strip()
    return None


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def compute_status(
    owner: Owner,
    generation: int,
    spec: InferenceServiceSpec,
    deployments: dict[str, dict[str, Any]],
    previous: dict[str, Any],
    now: str,
    problem: Problem | None = None,
    applied: bool = True,
    retiring: tuple[str, ...] = (),
    pods: list[dict[str, Any]] | None = None,
    notice: Problem | None = None,
) -> dict[str, Any]:
    """The operator-owned status fields (camelCase), ready to apply to the status subresource.

    `deployments` maps Deployment name -> live object; `previous` is the live status, used to
    keep lastTransitionTime when a condition's status did not change. `applied` is False when
    this generation's children could not all be applied (`problem` says why): the generation
    is then neither observed nor Ready. `retiring` names old pools kept serving until the new
    ones are ready (a mode switch); `pods` are the service's pods, read when a pool is short.
    `notice` is a difference that leaves the service working (a model cache claim that is not
    as specified): Degraded when nothing worse is.
    """
    roles = [r.value for r in spec.pools()] + [ROUTER]
    pools = {role: _pool(deployments.get(child_name(owner.name, role))) for role in roles}

    # Pools that scale to zero: while one starts its first replica the router holds requests,
    # so the service still serves (Ready), unless a pod of it cannot start.
    wakes = {
        r.value
        for r, pool in spec.pools().items()
        if pool.min_size == 0 and spec.autoscaling.enabled and spec.router.hold_seconds > 0
    }
    missing, not_ready, rolling, stuck, waking = [], [], [], [], []
    for role in roles:
        dep = deployments.get(child_name(owner.name, role))
        p = pools[role]
        if dep is None:
            missing.append(role)
            continue
        # A pool scaled to 0 is what its owner asked for, not a pool that is failing.
        if role in wakes and p["readyReplicas"] == 0 < p["desiredReplicas"]:
            waking.append(role)
        elif p["readyReplicas"] < p["desiredReplicas"]:
            not_ready.append(f"{role} {p['readyReplicas']}/{p['desiredReplicas']} ready")
        if not _rolled_out(dep):
            rolling.append(role)
        if (why := _stuck(dep)) is not None:
            stuck.append(
                f"Deployment {owner.namespace}/{dep['metadata']['name']} ({role}) stopped"
                f" progressing ({_cut(why)}); kubectl describe its pods for the cause"
            )

    if problem is None and (not_ready or waking) and pods:
        problem = pod_problem(pods)
    scaled_to_zero = [r for r in roles if r not in missing and pools[r]["desiredReplicas"] == 0]
    workers = [r for r in roles if r != ROUTER]

    if problem is not None and not applied:
        ready = _condition(READY, False, problem.reason, problem.message, generation)
    elif missing:
        ready = _condition(
            READY, False, "ChildrenMissing", f"not created yet: {', '.join(missing)}", generation
        )
    elif not_ready:
        ready = _condition(READY, False, "PodsNotReady", "; ".join(not_ready), generation)
    elif waking and problem is not None:
        ready = _condition(READY, False, problem.reason, problem.message, generation)
    else:
        zero = f" ({', '.join(scaled_to_zero)} scaled to 0)" if scaled_to_zero else ""
        if waking:
            zero += f" ({', '.join(waking)} waking from 0: the router holds requests)"
        ready = _condition(
            READY, True, "AllPodsReady", f"all pools and the router are ready{zero}", generation
        )

    moving = rolling + missing
    if retiring:
        message = (
            f"old pools {', '.join(retiring)} keep serving until"
            f" {', '.join(r for r in roles if r != ROUTER)} are ready"
        )
    else:
        message = f"rolling out: {', '.join(moving)}" if moving else "rollout complete"
    progressing = _condition(
        PROGRESSING,
        bool(moving or retiring) and applied,
        "RollingOut" if moving or retiring else "Complete",
        message,
        generation,
    )
    if problem is not None:
        degraded = _condition(DEGRADED, True, problem.reason, problem.message, generation)
    elif stuck:
        degraded = _condition(DEGRADED, True, "RolloutStuck", "; ".join(stuck), generation)
    elif notice is not None:
        degraded = _condition(DEGRADED, True, notice.reason, notice.message, generation)
    else:
        degraded = _condition(DEGRADED, False, "AsExpected", "", generation)

    conditions = _transitions([ready, progressing, degraded], previous, now)

    summaries = {
        field: f"{pools[role]['readyReplicas']}/{pools[role]['desiredReplicas']}"
        for role, field in SUMMARY_FIELDS.items()
        if role in pools
    }
    observed = generation if applied else previous.get("observedGeneration")
    scale = None
    if workers and all(r in scaled_to_zero for r in workers):
        scale = SCALED_TO_ZERO
    elif waking:
        scale = WAKING
    return {
        **({"observedGeneration": observed} if observed is not None else {}),
        "conditions": conditions,
        "pools": pools,
        **summaries,
        **({"scale": scale} if scale else {}),
        "endpoint": endpoint(owner),
    }


def _transitions(
    conditions: list[dict[str, Any]], previous: dict[str, Any], now: str
) -> list[dict[str, Any]]:
    """Sets lastTransitionTime: kept from `previous` while a condition's status holds."""
    before = {c["type"]: c for c in previous.get("conditions") or []}
    for cond in conditions:
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"]
        cond["lastTransitionTime"] = old.get("lastTransitionTime") if same and old else now
    return conditions


POOL_FIELDS = ("replicas", "readyReplicas", "desiredReplicas")  # the operator's, in pools.*


def invalid_status(
    generation: int, previous: dict[str, Any], problem: Problem, now: str
) -> dict[str, Any]:
    """Status for a spec the operator cannot use: not Ready, Degraded, this generation unobserved.

    The operator's other fields keep their last values (the children of the last good spec
    still run), so applying this does not drop them.
    """
    kept: dict[str, Any] = {
        k: previous[k]
        for k in ("observedGeneration", *SUMMARY_FIELDS.values(), "endpoint")
        if k in previous
    }
    if previous.get("pools"):
        kept["pools"] = {
            role: {k: v for k, v in pool.items() if k in POOL_FIELDS}
            for role, pool in previous["pools"].items()
        }
    conditions = [
        _condition(READY, False, problem.reason, problem.message, generation),
        _condition(
            PROGRESSING, False, problem.reason, "nothing rolls out until the spec is fixed",
            generation,
        ),
        _condition(DEGRADED, True, problem.reason, problem.message, generation),
    ]  # fmt: skip
    return {**kept, "conditions": _transitions(conditions, previous, now)}


def status_changed(desired: dict[str, Any], previous: dict[str, Any]) -> bool:
    """Whether applying `desired` would change anything (so unchanged status is not written)."""
    stale_pools = set(previous.get("pools") or {}) - set(desired.get("pools") or {})
    if stale_pools or previous.get("scale") != desired.get("scale"):  # scale may be left out
        return True
    without_conditions = {k: v for k, v in desired.items() if k != "conditions"}
    if not contains(previous, without_conditions):
        return True
    before = {c["type"]: c for c in previous.get("conditions") or []}
    return any(not contains(before.get(c["type"]), c) for c in desired["conditions"])
