"""kopf settings the handlers module installs (no kopf started, no API server)."""

from __future__ import annotations

from typing import Any

import kopf
from kopf._cogs.structs.references import Resource

from phasefleet.api.contract import CHILD_KINDS, ISVC_LABEL
from phasefleet.operator import handlers
from tests.operator.fake_api import FakeApi


def _settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    memo = kopf.Memo()
    memo.api = FakeApi()
    configure: Any = handlers.configure  # the kopf decorator's type wants kopf's own kwargs
    configure(settings=settings, memo=memo)
    return settings


def test_children_are_watched_through_a_server_side_label_selector():
    selectors = _settings().watching.label_selectors
    for child in CHILD_KINDS:
        resource = Resource(
            group=child.group, version=child.version, plural=child.plural, kind=child.kind
        )
        assert list(selectors.collect(resource)) == [ISVC_LABEL], child.kind


def test_other_resources_are_not_filtered():
    selectors = _settings().watching.label_selectors
    for resource in (
        Resource("serving.phasefleet.dev", "v1alpha1", "inferenceservices"),
        Resource("serving.knative.dev", "v1", "services"),  # same plural, other group
        Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"),
        Resource("", "v1", "namespaces"),
    ):
        assert list(selectors.collect(resource)) == [], resource


def test_only_the_services_pods_are_watched():
    selectors = _settings().watching.label_selectors
    pods = Resource("", "v1", "pods", kind="Pod")
    assert list(selectors.collect(pods)) == [ISVC_LABEL]
