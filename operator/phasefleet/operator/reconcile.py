"""One reconcile pass over an InferenceService, and the cheaper pass for one child's event.

Plain functions over `kube.Api`, so tests drive them with an in-memory fake. The kopf
handlers map the exceptions here onto kopf's retry taxonomy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from phasefleet.api.contract import CHILD_KINDS
from phasefleet.api.crd import API_VERSION, KIND
from phasefleet.api.spec import InferenceServiceSpec, parse_spec
from phasefleet.operator.children import desired_children, key
from phasefleet.operator.compare import contains
from phasefleet.operator.kube import Api, Rejected
from phasefleet.operator.meta import ISVC_LABEL, Owner, is_owned_by
from phasefleet.operator.status import Problem, compute_status, status_changed

PROBLEM_RETRY_SECONDS = 20  # how soon a missing PVC or Secret is looked for again


class InvalidSpec(Exception):
    """The spec fails validation the API server could not do; only a spec change helps."""


class Blocked(Exception):
    """A referenced object is missing; reported in status and retried."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)  # "Kind/name" created or changed
    deleted: list[str] = field(default_factory=list)  # "Kind/name" no longer wanted
    status_written: bool = False
    parent: dict[str, Any] | None = None  # the InferenceService (for events)


def _ref(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def parse(body: dict[str, Any]) -> InferenceServiceSpec:
    try:
        return parse_spec(dict(body.get("spec") or {}))
    except ValidationError as exc:
        name = body["metadata"]["name"]
        raise InvalidSpec(f"InferenceService {name}: invalid spec: {exc}") from exc


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
    token = spec.model.hf.token_secret if spec.model.hf else None
    if token is not None:
        try:
            secret = api.get("Secret", ns, token.name)
        except Rejected:  # the chart's rbac.readSecrets=false: the pods will report it instead
            return None
        if secret is None:
            return Problem(
                "TokenSecretMissing",
                f"Secret {ns}/{token.name} not found: create it with key '{token.key}',"
                " or change spec.model.hf.tokenSecret",
            )
        keys = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
        if token.key not in keys:  # only key names are read; values never leave the Secret
            return Problem(
                "TokenSecretKeyMissing",
                f"Secret {ns}/{token.name} has no key '{token.key}': add it, or change"
                " spec.model.hf.tokenSecret.key",
            )
    return None


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


def write_status(
    api: Api,
    body: dict[str, Any],
    spec: InferenceServiceSpec,
    deployments: dict[str, dict[str, Any]],
    now: str,
    problem: Problem | None = None,
) -> bool:
    """Applies the operator's status fields if they changed; True when it wrote."""
    owner = Owner.from_body(body)
    previous = dict(body.get("status") or {})
    generation = int(body["metadata"].get("generation") or 0)
    status = compute_status(owner, generation, spec, deployments, previous, now, problem)
    if not status_changed(status, previous):
        return False
    api.apply_status(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": owner.name, "namespace": owner.namespace},
            "status": status,
        }
    )
    return True


def reconcile(api: Api, body: dict[str, Any], now: str) -> Outcome:
    """Applies every child, deletes children no longer wanted, writes status.

    Raises InvalidSpec, Blocked (after writing a Degraded status), kube.Transient, kube.Rejected.
    """
    owner = Owner.from_body(body)
    spec = parse(body)
    live = live_children(api, owner)
    deployments = _deployments(live)
    problem = preflight(api, owner, spec)
    if problem is not None:
        write_status(api, body, spec, deployments, now, problem)
        raise Blocked(problem)

    outcome = Outcome()
    live_replicas = {name: int(d["spec"].get("replicas") or 0) for name, d in deployments.items()}
    desired = desired_children(owner, spec, live_replicas)
    for obj in desired:
        before = live.get(key(obj))
        try:
            after = api.apply(obj)
        except Rejected as exc:
            problem = Problem("ChildRejected", f"{_ref(obj)} was rejected; check the spec: {exc}")
            write_status(api, body, spec, deployments, now, problem)
            raise
        version = after["metadata"].get("resourceVersion")
        if before is None or before["metadata"].get("resourceVersion") != version:
            outcome.applied.append(_ref(obj))
        if obj["kind"] == "Deployment":
            deployments[obj["metadata"]["name"]] = after
    wanted = {key(obj) for obj in desired}
    for (kind, name), obj in live.items():
        if (kind, name) not in wanted:
            api.delete(kind, owner.namespace, name)
            if kind == "Deployment":
                deployments.pop(name, None)
            outcome.deleted.append(_ref(obj))
    outcome.status_written = write_status(api, body, spec, deployments, now)
    return outcome


def sync_child(api: Api, child: dict[str, Any], deleted: bool, now: str) -> Outcome | None:
    """After an event on one child: restore it if it drifted or was deleted, refresh status.

    Returns None when the child's owner is gone, being deleted, or not ours to manage.
    """
    meta = child["metadata"]
    parent = api.get(KIND, meta["namespace"], meta["labels"][ISVC_LABEL])
    if parent is None or parent["metadata"].get("deletionTimestamp"):
        return None
    owner = Owner.from_body(parent)
    if not is_owned_by(child, owner):
        return None
    try:
        spec = parse(parent)
    except InvalidSpec:
        return None  # the InferenceService's own handler reports it
    if preflight(api, owner, spec) is not None:
        return None  # the InferenceService's own handler reports and retries it

    outcome = Outcome(parent=parent)
    live_replicas = {} if deleted else {meta["name"]: int(child["spec"].get("replicas") or 0)}
    wanted = {key(o): o for o in desired_children(owner, spec, live_replicas)}
    desired = wanted.get(key(child))
    if desired is None:
        return outcome  # no longer wanted: the next full reconcile deletes it
    if deleted or not contains(child, desired):
        api.apply(desired)
        outcome.applied.append(_ref(desired))
    if child["kind"] == "Deployment":
        deployments = _deployments(live_children(api, owner, ("Deployment",)))
        outcome.status_written = write_status(api, parent, spec, deployments, now)
    return outcome
