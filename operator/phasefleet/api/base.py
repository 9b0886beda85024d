"""The base of every API model: camelCase names, CEL rules mirrored by Python checks."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

# A Kubernetes resource quantity ("500m", "16Gi", 2): int-or-string in the CRD schema.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "maxLength": 64,
        }
    ),
]

_SUFFIXES = {
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
}  # fmt: skip


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity as a number ("1536Mi" -> 1610612736), or None."""
    text = str(value)
    if isinstance(value, bool) or not re.match(QUANTITY_PATTERN, text):
        return None
    match = re.match(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9.]+)?)([KMGTPE]i|[numkMGTPE]?)$", text)
    try:
        if match is None:
            return None
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
    except InvalidOperation:
        return None


# A Kubernetes core type we pass through unchanged (affinity, valueFrom): kept as-is by the
# API server, checked by Kubernetes when it lands in a pod template.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


@dataclass(frozen=True)
class Rule:
    """One cross-field constraint, enforced twice: by the API server (CEL) and in Python.

    `cel` and `check` must agree; tests/api and the e2e CRD tests feed the same invalid objects
    to both. `message` names the offending field so a user knows what to change.
    """

    cel: str  # CEL expression over `self` (the object this rule is attached to)
    message: str  # shown by the API server and raised by Python
    check: Callable[[Any], bool]  # the same rule over the pydantic model; True = valid
    field_path: str | None = None  # JSONPath relative to `self` the error is reported on
    message_expression: str | None = None  # CEL string expression with the bad values

    def to_schema(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.message_expression:
            out["messageExpression"] = self.message_expression
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def _add_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        extra="forbid",
        json_schema_extra=_add_rules,
    )

    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> ApiModel:
        for rule in self.rules:
            if not rule.check(self):
                path = (rule.field_path or "").lstrip(".")
                raise ValueError(f"{path}: {rule.message}" if path else rule.message)
        return self

    def to_wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
