"""One reconcile pass over an InferenceService: the only path that writes children or status.

Plain functions over `kube.Api`, so tests drive them with an in-memory fake. The kopf
handlers map the exceptions here onto kopf's retry taxonomy. A child's or a pod's event runs
the same pass over its owner (`sync_owner`), so an event can never report a state the owner's
own reconcile would not, and `one_at_a_time` keeps two passes over one owner from interleaving.
Events that arrive while an event's pass over their owner is still waiting its turn are folded
into it (`event_pass`): that pass reads everything after they arrived.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from phasefleet.api.contract import CHILD_KINDS
from phasefleet.api.crd import API_VERSION, KIND
from phasefleet.api.names import InvalidService, validate_service
from phasefleet.api.spec import InferenceServiceSpec, SecretKeyRef
from phasefleet.operator.cache_claim import cache_claim, claim_conflict, claim_notice
from phasefleet.operator.children import desired_children, internal_token_secret, key
from phasefleet.operator.compare import in_sync
from phasefleet.operator.kube import Api, NamespaceTerminating, Rejected
from phasefleet.operator.meta import (
    AUTOSCALER_FIELD_MANAGER,
    FIELD_MANAGER,
    ISVC_LABEL,
    ROLE_LABEL,
    ROUTER,
    Owner,
    child_name,
    is_owned_by,
    replicas_managers,
)
from phasefleet.operator.status import (
    MAX_CAUSE,
    Problem,
    compute_status,
    degraded_news,
    invalid_status,
    pool_ready,
    status_changed,
)
from phasefleet.operator.workloads import internal_token_secret_name

log = logging.getLogger(__name__)
PROBLEM_RETRY_SECONDS = 20  # how soon a missing PVC or Secret, or a rejected child, is retried

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
_waiting: set[tuple[str, str]] = set()  # owners with an event pass waiting for their lock


@contextlib.contextmanager
def one_at_a_time(namespace: str, name: str) -> Iterator[None]:
    """Serialises reconcile passes over one InferenceService (handlers run in threads)."""
    with _locks_guard:
        lock = _locks.setdefault((namespace, name), threading.Lock())
    with lock:
        yield


def event_pass(namespace: str, name: str, run: Callable[[], Outcome | None]) -> Outcome | None:
    """`run` (a child's or a pod's pass over their owner) in its turn, as `one_at_a_time`; None
    at once when another event's pass over the owner is already waiting for its turn: that pass
    starts after this event arrived and reads the owner and its children fresh, so running
    this one after it would repeat it. Events that come while a pass waits cost no pass, and
    their handler threads do not wait behind it."""
    key = (namespace, name)
    with _locks_guard:
        if key in _waiting:
            return None
        _waiting.add(key)  # only this pass takes it out, once the lock is its own
    with one_at_a_time(namespace, name):
        with _locks_guard:
            _waiting.discard(key)
        return run()


class InvalidSpec(Exception):
    """The spec fails validation the API server could not do; only a spec change helps."""


class Blocked(Exception):
    """A referenced object is missing or a child was refused; reported in status and retried."""

    def __init__(self, problem: Problem, news: bool = True) -> None:
        super().__init__(problem.message)
        self.problem = problem
        self.news = news  # the pass wrote this Degraded text first: worth one Warning event


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)  # "Kind/name" created or changed
    deleted: list[str] = field(default_factory=list)  # "Kind/name" no longer wanted
    status_written: bool = False
    parent: dict[str, Any] | None = None  # the InferenceService (for events)
    degraded: Problem | None = None  # a Degraded text this pass wrote first: one Warning event


def _ref(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def parse(body: dict[str, Any]) -> InferenceServiceSpec:
    meta = body["metadata"]
    try:
        return validate_service(meta["name"], dict(body.get("spec") or {}))
    except InvalidService as exc:
        where = f"InferenceService {meta.get('namespace')}/{meta['name']}"
        raise InvalidSpec(f"{where} is invalid, change it: {exc}") from exc


def rejected_problem(owner: Owner, obj: dict[str, Any], exc: Rejected) -> Problem:
    """A child the API server refused, as one sentence: the child, the cause, the fix."""
    ref = f"{obj['kind']} {owner.namespace}/{obj['metadata']['name']}"
    cause = " ".join(exc.message.split())[:MAX_CAUSE]
    if "exceeded quota" in exc.message:
        fix = (
            f"raise the ResourceQuota in namespace {owner.namespace}, or ask for fewer"
            f" replicas or resources in InferenceService {owner.namespace}/{owner.name}"
        )
    elif exc.code in (401, 403):
        fix = (
            "grant the operator's ServiceAccount this right (the chart's RBAC, and"
            f" watchNamespaces must include {owner.namespace})"
        )
    else:
        fix = (
            f"change InferenceService {owner.namespace}/{owner.name} so this child is valid;"
            f" the operator retries every {PROBLEM_RETRY_SECONDS} s"
        )
    return Problem("ChildRejected", f"The API server refused {ref} ({cause}); {fix}")


def preflight(api: Api, owner: Owner, spec: InferenceServiceSpec) -> Problem | None:
    """Objects the pods need that the user must create; None when all exist."""
    ns = owner.namespace
    pvc = spec.model.pvc
    if pvc is not None and api.get("PersistentVolumeClaim", ns, pvc.claim_name) is None:
        return Problem(
            "ModelVolumeMissing",
            f"PersistentVolumeClaim {ns}/{pvc.claim_name} not found: create it with the model"
            " folder, or change spec.model.pvc.claimName",
        )
    claim = spec.model.cache.claim_name if spec.model.cache else None
    if claim is not None and api.get("PersistentVolumeClaim", ns, claim) is None:
        return Problem(
            "ModelCacheMissing",
            f"PersistentVolumeClaim {ns}/{claim} (spec.model.cache.claimName) not found: create"
            " it (ReadWriteMany when the pods run on several nodes), or use"
            " spec.model.cache.pvc to have the operator create one",
        )
    token = spec.model.hf.token_secret if spec.model.hf else None
    if token is not None:
        problem = _secret_problem(api, ns, token, "spec.model.hf.tokenSecret", "TokenSecret")
        if problem is not None:
            return problem
    if spec.auth is not None:
        key = spec.auth.api_key_secret
        return _secret_problem(api, ns, key, "spec.auth.apiKeySecret", "ApiKeySecret")
    return None


def _secret_problem(
    api: Api, ns: str, ref: SecretKeyRef, field: str, reason: str
) -> Problem | None:
    """`<reason>Missing` / `<reason>KeyMissing` when the Secret or its key is not there; None
    when they are, or when the operator may not read Secrets (the pods will say so)."""
    try:
        secret = api.get("Secret", ns, ref.name)
    except Rejected:  # the chart's rbac.readSecrets=false
        return None
    if secret is None:
        return Problem(
            f"{reason}Missing",
            f"Secret {ns}/{ref.name} not found: create it with key '{ref.key}', or change {field}",
        )
    keys = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
    if ref.key not in keys:  # only key names are read; values never leave the Secret
        return Problem(
            f"{reason}KeyMissing",
            f"Secret {ns}/{ref.name} has no key '{ref.key}': add it, or change {field}.key",
        )
    return None


@dataclass(frozen=True)
class ClaimCheck:
    """The model cache's claim after `ensure_cache_claim`."""

    blocked: Problem | None = None  # a claim of that name the service does not own: stop here
    notice: Problem | None = None  # the service's claim differs from the spec: Degraded only


def ensure_cache_claim(
    api: Api, owner: Owner, spec: InferenceServiceSpec, outcome: Outcome
) -> ClaimCheck:
    """Creates the model cache's claim (spec.model.cache.pvc) if it is not there; a live one
    is only compared with the spec, never applied. Raises Rejected when the create is refused."""
    desired = cache_claim(owner, spec)
    cache = spec.model.cache
    if desired is None or cache is None or cache.pvc is None:
        return ClaimCheck()
    name = desired["metadata"]["name"]
    live = api.get("PersistentVolumeClaim", owner.namespace, name)
    if live is None:
        log.info("create %s/PersistentVolumeClaim/%s: not there", owner.namespace, name)
        if api.create(desired):
            outcome.applied.append(f"PersistentVolumeClaim/{name}")
        return ClaimCheck()
    conflict = claim_conflict(owner, live)
    if conflict is not None:
        return ClaimCheck(blocked=conflict)
    return ClaimCheck(notice=claim_notice(owner, cache.pvc, live))


ALL_KINDS = tuple(child.kind for child in CHILD_KINDS)


def live_children(
    api: Api, owner: Owner, kinds: tuple[str, ...] = ALL_KINDS
) -> dict[tuple[str, str], dict[str, Any]]:
    selector = f"{ISVC_LABEL}={owner.name}"
    out = {}
    for kind in kinds:
        for obj in api.list(kind, owner.namespace, selector):
            if is_owned_by(obj, owner):
                out[key(obj)] = obj
    return out


def _deployments(live: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: obj for (kind, name), obj in live.items() if kind == "Deployment"}


def _pods(api: Api, owner: Owner, deployments: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The service's pods, read only while some Deployment has fewer ready pods than wanted."""
    short = any(
        int((d.get("status") or {}).get("readyReplicas") or 0) < int(d["spec"].get("replicas") or 0)
        for d in deployments.values()
    )
    return api.list("Pod", owner.namespace, f"{ISVC_LABEL}={owner.name}") if short else []


def _apply_status(api: Api, owner: Owner, status: dict[str, Any]) -> None:
    api.apply_status(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": owner.name, "namespace": owner.namespace},
            "status": status,
        }
    )


def reclaims_replicas(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Autoscaling was turned off and the autoscaler alone owns the live spec.replicas: the
    operator applies its number even when equal, so the field is its own again."""
    if "replicas" not in desired.get("spec", {}):
        return False
    managers = replicas_managers(live)
    return AUTOSCALER_FIELD_MANAGER in managers and FIELD_MANAGER not in managers


def write_invalid_status(api: Api, body: dict[str, Any], message: str, now: str) -> bool:
    """Reports a spec the operator cannot use (InvalidSpec) in status; True when it wrote."""
    previous = dict(body.get("status") or {})
    generation = int(body["metadata"].get("generation") or 0)
    status = invalid_status(generation, previous, Problem("InvalidSpec", message), now)
    if not status_changed(status, previous):
        return False
    _apply_status(api, Owner.from_body(body), status)
    return True


def write_status(
    api: Api,
    body: dict[str, Any],
    spec: InferenceServiceSpec,
    deployments: dict[str, dict[str, Any]],
    now: str,
    problem: Problem | None = None,
    retiring: tuple[str, ...] = (),
    notice: Problem | None = None,
) -> dict[str, Any] | None:
    """Applies the operator's status fields if they changed; returns what it wrote, if it did.

    With a `problem`, this generation's children were not all applied: it is not observed. A
    `notice` is Degraded while nothing worse is.
    """
    owner = Owner.from_body(body)
    previous = dict(body.get("status") or {})
    generation = int(body["metadata"].get("generation") or 0)
    pods = _pods(api, owner, deployments) if problem is None else []
    status = compute_status(
        owner, generation, spec, deployments, previous, now, problem,
        applied=problem is None, retiring=retiring, pods=pods, notice=notice,
    )  # fmt: skip
    if not status_changed(status, previous):
        return None
    _apply_status(api, owner, status)
    return status


def _blocked(
    api: Api,
    body: dict[str, Any],
    spec: InferenceServiceSpec,
    deployments: dict[str, dict[str, Any]],
    now: str,
    problem: Problem,
) -> Blocked:
    """Writes the problem into status; the Blocked to raise says whether that was news (a
    retry of the same problem every PROBLEM_RETRY_SECONDS posts no new event)."""
    previous = dict(body.get("status") or {})
    written = write_status(api, body, spec, deployments, now, problem)
    return Blocked(problem, news=written is not None and bool(degraded_news(written, previous)))


def reconcile(api: Api, body: dict[str, Any], now: str) -> Outcome:
    """Applies the children that differ from the spec, retires unwanted ones, writes status.

    Children already holding what the spec asks for are not applied again. Children no
    longer wanted (the old pools after a mode switch) are deleted once every new pool is
    ready, so the service keeps serving meanwhile. Raises InvalidSpec, Blocked (after writing
    a Degraded status that leaves the generation unobserved), kube.Transient, kube.Rejected.
    """
    owner = Owner.from_body(body)
    try:
        spec = parse(body)
    except InvalidSpec as exc:
        write_invalid_status(api, body, str(exc), now)
        raise
    live = live_children(api, owner)
    deployments = _deployments(live)
    problem = preflight(api, owner, spec)
    if problem is not None:
        raise _blocked(api, body, spec, deployments, now, problem)

    outcome = Outcome(parent=body)
    try:
        claim = ensure_cache_claim(api, owner, spec, outcome)
    except NamespaceTerminating:
        raise
    except Rejected as exc:
        problem = rejected_problem(owner, cache_claim(owner, spec) or {}, exc)
        raise _blocked(api, body, spec, deployments, now, problem) from exc
    if claim.blocked is not None:
        raise _blocked(api, body, spec, deployments, now, claim.blocked)
    live_replicas = {name: int(d["spec"].get("replicas") or 0) for name, d in deployments.items()}
    autoscaled = frozenset(
        name for name, d in deployments.items() if AUTOSCALER_FIELD_MANAGER in replicas_managers(d)
    )
    desired = desired_children(owner, spec, live_replicas, autoscaled)
    # A new service (or one from before the hand-off) gets its internal token, made once. It
    # is never applied again or read: pods get it from the Secret itself.
    new_service = ("ServiceAccount", child_name(owner.name, ROUTER)) not in live
    if new_service and api.create(internal_token_secret(owner)):
        outcome.applied.append(f"Secret/{internal_token_secret_name(owner.name)}")
    for obj in desired:
        before = live.get(key(obj))
        if before is not None and in_sync(before, obj) and not reclaims_replicas(before, obj):
            continue
        log.info(
            "apply %s/%s: %s",
            owner.namespace,
            _ref(obj),
            "differs from the live one" if before else "not there",
        )
        try:
            after = api.apply(obj)
        except NamespaceTerminating:
            raise  # nothing can be created there any more; not a problem with the spec
        except Rejected as exc:
            problem = rejected_problem(owner, obj, exc)
            raise _blocked(api, body, spec, deployments, now, problem) from exc
        version = after["metadata"].get("resourceVersion")
        if before is None or before["metadata"].get("resourceVersion") != version:
            outcome.applied.append(_ref(obj))
        if obj["kind"] == "Deployment":
            deployments[obj["metadata"]["name"]] = after

    wanted = {key(obj) for obj in desired}
    unwanted = {k: obj for k, obj in live.items() if k not in wanted}
    new_pools = [deployments.get(child_name(owner.name, role.value)) for role in spec.pools()]
    retiring: tuple[str, ...] = ()
    if unwanted and not all(pool_ready(d) for d in new_pools):
        roles = {
            (o["metadata"].get("labels") or {}).get(ROLE_LABEL, "?") for o in unwanted.values()
        }
        retiring = tuple(sorted(roles))
    else:
        for (kind, name), obj in unwanted.items():
            api.delete(kind, owner.namespace, name)
            if kind == "Deployment":
                deployments.pop(name, None)
            outcome.deleted.append(_ref(obj))
    previous = dict(body.get("status") or {})
    written = write_status(
        api, body, spec, deployments, now, retiring=retiring, notice=claim.notice
    )
    outcome.status_written = written is not None
    if written is not None:
        outcome.degraded = degraded_news(written, previous)
    return outcome


def owns_child(api: Api, child: dict[str, Any]) -> bool:
    """Whether the InferenceService the child's label names exists and controls it."""
    meta = child["metadata"]
    name = (meta.get("labels") or {}).get(ISVC_LABEL)
    parent = api.get(KIND, meta["namespace"], name) if name else None
    return parent is not None and is_owned_by(child, Owner.from_body(parent))


def sync_owner(api: Api, namespace: str, owner_name: str, now: str) -> Outcome | None:
    """After an event on one of the service's children or pods: the owner's pass, if this
    generation is settled. (A container that fails, or a pod the scheduler cannot place,
    changes no Deployment, so without pod events the Degraded condition would wait for one.)

    Returns None when the owner is gone, being deleted, or its current generation is still
    with its own handler (not yet observed: being applied, or retried after a problem).
    Otherwise the Outcome's `applied` lists what drifted.
    """
    parent = api.get(KIND, namespace, owner_name)
    if parent is None or parent["metadata"].get("deletionTimestamp"):
        return None
    return _settled_pass(api, parent, now)


def _settled_pass(api: Api, parent: dict[str, Any], now: str) -> Outcome | None:
    observed = (parent.get("status") or {}).get("observedGeneration")
    if observed != parent["metadata"].get("generation"):
        return None  # still with the owner's own handler (being applied, or retried)
    return reconcile(api, parent, now)
