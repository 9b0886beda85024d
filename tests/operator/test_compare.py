"""Semantic comparison of live children with what the operator would apply."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from phasefleet.api.base import quantity
from phasefleet.operator.compare import contains


@pytest.mark.parametrize(
    ("text", "value"),
    [("1.5Gi", 1610612736), ("1536Mi", 1610612736), ("500m", Decimal("0.5")), (2, 2),
     ("1e3", 1000), ("16G", 16 * 10**9)],
)  # fmt: skip
def test_quantities_parse_as_numbers(text: object, value: object) -> None:
    assert quantity(text) == value


def test_normalised_quantities_are_the_same_resources() -> None:
    desired = {"resources": {"limits": {"memory": "1.5Gi", "cpu": "1"}}}
    assert contains({"resources": {"limits": {"memory": "1536Mi", "cpu": "1000m"}}}, desired)
    assert not contains({"resources": {"limits": {"memory": "1Gi", "cpu": "1"}}}, desired)


def test_quantity_rules_apply_only_to_resources() -> None:
    assert not contains({"args": ["1000m"]}, {"args": ["1"]})
    assert not contains({"maxSurge": "1000m"}, {"maxSurge": 1})


def test_defaults_and_extra_keyed_items_from_other_managers_are_fine() -> None:
    desired = {
        "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        "selector": {"a": "b"},
    }
    live: dict[str, Any] = {
        "ports": [
            {"name": "metrics", "port": 9090, "protocol": "TCP", "targetPort": 9090},
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": "http"},
        ],
        "selector": {"a": "b"},
        "clusterIP": "10.0.0.1",
        "sessionAffinity": "None",
    }
    assert contains(live, desired)
    live["ports"][1]["port"] = 81
    assert not contains(live, desired)


def test_unkeyed_lists_are_compared_in_order() -> None:
    assert contains({"args": ["a", "b"]}, {"args": ["a", "b"]})
    assert not contains({"args": ["a", "b", "c"]}, {"args": ["a", "b"]})
    assert not contains({"args": ["b", "a"]}, {"args": ["a", "b"]})


def test_empty_desired_values_may_be_absent() -> None:
    assert contains({"volumes": [{"name": "tmp"}]}, {"volumes": [{"name": "tmp", "emptyDir": {}}]})
    assert contains({}, {"resources": {}})
    assert not contains({}, {"replicas": 0})
