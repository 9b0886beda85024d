"""kopf handlers: thin wrappers that call `reconcile` and map its errors onto kopf's retries.

Watched: InferenceServices (create, update, resume on operator start) and their children
(Deployments, Services, PodDisruptionBudgets labelled phasefleet.dev/inferenceservice), so a
child edited or deleted by hand is restored at once and Deployment readiness reaches status;
and their pods, so a pod that cannot run (which changes no Deployment) reaches Degraded. A
Degraded text a pass writes first is posted once as a Warning event with the same words.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any, cast

import kopf

from phasefleet.api.contract import CHILD_KINDS, ISVC_LABEL
from phasefleet.api.crd import GROUP, KIND, PLURAL, VERSION
from phasefleet.operator.kube import Api, Gone, Kube, NamespaceTerminating, Rejected, Transient
from phasefleet.operator.reconcile import (
    PROBLEM_RETRY_SECONDS,
    Blocked,
    InvalidSpec,
    Outcome,
    event_pass,
    one_at_a_time,
    owns_child,
    reconcile,
    sync_owner,
)

TRANSIENT_RETRY_SECONDS = 5
STORAGE_PREFIX = "phasefleet.dev"
PODS = ("", "v1", "pods")  # group, version, plural


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def plain(value: Any) -> Any:
    """kopf's read-only body views -> plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and the last-handled spec live in annotations: the CRD's status schema has no
    # room for kopf's fields (the API server would prune them).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=STORAGE_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=STORAGE_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{STORAGE_PREFIX}/finalizer"
    settings.posting.level = logging.WARNING  # Normal events are posted explicitly below
    settings.execution.max_workers = 8  # reconciles at once (each is ~13 API calls)
    # Restart watches every few minutes: a watch silently stalled by a network middlebox
    # would otherwise stop all events without an error.
    settings.watching.server_timeout = 300  # seconds
    settings.watching.client_timeout = 330  # seconds
    # Children are watched through a server-side label selector: the `labels=` filter of the
    # child handlers below only filters client-side, after every Deployment, Service and PDB
    # in the cluster has been listed, streamed and kept in memory.
    for child in CHILD_KINDS:
        key = (child.group, child.version, child.plural)
        settings.watching.label_selectors[key] = ISVC_LABEL
    settings.watching.label_selectors[PODS] = ISVC_LABEL  # the services' pods, no others
    if getattr(memo, "api", None) is None:
        memo.api = Kube.from_environment()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile_service(
    body: kopf.Body, reason: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    started = time.monotonic()
    try:
        namespace, name = body.metadata.namespace or "", body.metadata.name or ""
        with one_at_a_time(namespace, name):
            # Re-read under the lock: a child's pass may have written status since kopf's
            # snapshot, and status is only written when it differs from the live one.
            live = memo.api.get(KIND, namespace, name)
            if live is None:
                return  # deleted meanwhile; the garbage collector removes the children
            outcome = reconcile(memo.api, live, _now())
    except (Gone, NamespaceTerminating):
        return  # deleted, or its namespace is: the garbage collector removes the children
    except InvalidSpec as exc:
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(exc)[:1024])
        raise kopf.PermanentError(str(exc)) from exc
    except Blocked as exc:
        if exc.news:  # once per problem, not at every retry
            kopf.event(body, type="Warning", reason=exc.problem.reason, message=exc.problem.message)
        raise kopf.TemporaryError(exc.problem.message, delay=PROBLEM_RETRY_SECONDS) from exc
    except Rejected as exc:  # not a child: e.g. the status subresource, or a forbidden list
        kopf.event(body, type="Warning", reason="RequestRejected", message=str(exc)[:1024])
        raise kopf.TemporaryError(str(exc), delay=PROBLEM_RETRY_SECONDS) from exc
    except Transient as exc:
        raise kopf.TemporaryError(str(exc), delay=TRANSIENT_RETRY_SECONDS) from exc
    changes = outcome.applied + [f"deleted {ref}" for ref in outcome.deleted]
    if changes:
        event_reason = "Created" if reason == "create" else "Updated"
        kopf.event(body, type="Normal", reason=event_reason, message=", ".join(changes))
    post_degraded(body, outcome)
    logger.info(
        "reconciled (%s) in %.3fs: %d changed, status written: %s",
        reason, time.monotonic() - started, len(changes), outcome.status_written,
    )  # fmt: skip


def owner_event_pass(api: Api, namespace: str, owner: str) -> Outcome | None:
    """The owner's pass after an event on its child or pod, folded into one already waiting."""
    return event_pass(namespace, owner, lambda: sync_owner(api, namespace, owner, _now()))


def child_event(
    body: kopf.Body, type: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    namespace = body.metadata.namespace or ""
    owner = (body.metadata.labels or {}).get(ISVC_LABEL, "")
    try:
        if not owns_child(memo.api, plain(body)):
            return  # not a child of a live service (a look-alike, or its owner is gone)
        outcome = owner_event_pass(memo.api, namespace, owner)
    except (NamespaceTerminating, Gone):
        return  # the owner or its namespace is going away; nothing to restore
    except (InvalidSpec, Blocked):
        return  # written to the owner's status by the pass; its own handler retries
    except (Transient, Rejected) as exc:
        # Event handlers are not retried; the next event or the owner's handler catches up.
        logger.warning("could not sync %s: %s", body.get("kind"), exc)
        return
    if outcome is not None and outcome.parent is not None:
        post_settled_pass(kopf.Body(cast(Any, outcome.parent)), outcome, logger)


def post_settled_pass(parent: kopf.Body, outcome: Outcome, logger: kopf.Logger) -> None:
    """The events of an owner's pass run for a child's or a pod's event: what it restored,
    the old pools it deleted (a mode switch, once the new pools are ready), and Degraded."""
    if outcome.applied:
        message = f"restored {', '.join(outcome.applied)} (edited or deleted outside the operator)"
        kopf.event(parent, type="Normal", reason="DriftCorrected", message=message)
        logger.info(message)
    if outcome.deleted:
        message = f"deleted {', '.join(outcome.deleted)}: the pools replacing them are ready"
        kopf.event(parent, type="Normal", reason="Updated", message=message)
        logger.info(message)
    post_degraded(parent, outcome)


def post_degraded(body: kopf.Body, outcome: Outcome) -> None:
    """The Degraded text this pass wrote first, as a Warning event in the same words."""
    if outcome.degraded is not None:
        problem = outcome.degraded
        kopf.event(body, type="Warning", reason=problem.reason, message=problem.message)


def _ready(pod: kopf.Body) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@kopf.on.event(*PODS, labels={ISVC_LABEL: kopf.PRESENT})
def pod_event(
    body: kopf.Body, type: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """A pod of a service changed: unless it is ready or gone (its Deployment's status says
    so), the owner's pass runs to read why it cannot run."""
    if type == "DELETED" or _ready(body) or body.metadata.get("deletionTimestamp"):
        return
    namespace = body.metadata.namespace or ""
    owner = (body.metadata.labels or {}).get(ISVC_LABEL, "")
    try:
        outcome = owner_event_pass(memo.api, namespace, owner)
    except (NamespaceTerminating, Gone, InvalidSpec, Blocked):
        return  # as for a child's event: the owner's own handler reports and retries
    except (Transient, Rejected) as exc:
        logger.warning("could not read pod %s: %s", body.metadata.name, exc)
        return
    if outcome is not None and outcome.parent is not None:
        # the pass may also retire the old pools: their event is posted as for a child's
        post_settled_pass(kopf.Body(cast(Any, outcome.parent)), outcome, logger)


for _child in CHILD_KINDS:
    kopf.on.event(_child.group, _child.version, _child.plural, labels={ISVC_LABEL: kopf.PRESENT})(
        child_event
    )
