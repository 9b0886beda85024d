"""What an InferenceService may be called: its children's names must be valid Service names.

Children are named `<name>-prefill`, `-decode`, `-worker` and `-router`, and each is also a
Service, whose name Kubernetes requires to be a DNS-1035 label: at most 63 characters of
lowercase letters, digits and '-', starting with a letter and ending with a letter or digit.
`metadata.name` itself may hold dots (it is a DNS subdomain), so the CRD has to say so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from phasefleet.api.base import Rule
from phasefleet.api.contract import ROUTER_ROLE
from phasefleet.api.spec import InferenceServiceSpec, Role, parse_spec

SERVICE_NAME_LIMIT = 63  # a DNS-1035 label
CHILD_SUFFIXES = tuple(f"-{role}" for role in [*(r.value for r in Role), ROUTER_ROLE])
MAX_NAME_LENGTH = SERVICE_NAME_LIMIT - max(len(s) for s in CHILD_SUFFIXES)
DNS_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

NAME_RULES = (
    Rule(
        cel=f"self.metadata.name.matches('{DNS_1035}')",
        message=(
            "metadata.name must start with a lowercase letter and hold only lowercase letters,"
            " digits and '-' (no dots): its children <name>-prefill, -decode, -worker and"
            " -router are Services, whose names are DNS-1035 labels; e.g. use llama-3-1-8b"
            " for llama-3.1-8b and keep the model name in spec.model.servedName"
        ),
        check=lambda name: re.match(DNS_1035, name) is not None,
    ),
    Rule(
        cel=f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        message=(
            f"metadata.name must be at most {MAX_NAME_LENGTH} characters: its longest child,"
            f" <name>-prefill, is a Service, whose name may be at most {SERVICE_NAME_LIMIT}"
        ),
        check=lambda name: len(name) <= MAX_NAME_LENGTH,
    ),
)


@dataclass(frozen=True)
class NamedService:
    """What the root rules on name and spec together see."""

    name: str
    spec: InferenceServiceSpec

    def served_name(self) -> str:
        return self.spec.model.served_name or self.name


SERVED_NAME = "(has(self.spec.model.servedName) ? self.spec.model.servedName : self.metadata.name)"
SERVICE_RULES = (
    Rule(
        cel=f"!has(self.spec.lora) || self.spec.lora.adapters.all(a, a.name != {SERVED_NAME})",
        message=(
            "spec.lora.adapters: an adapter may not have the served model's name"
            " (spec.model.servedName, or metadata.name when unset): a request's model names one"
            " or the other; rename the adapter"
        ),
        check=lambda s: (
            s.spec.lora is None or all(a.name != s.served_name() for a in s.spec.lora.adapters)
        ),
        field_path=".spec.lora.adapters",
    ),
)


def name_problem(name: str) -> str | None:
    """Why `name` cannot be an InferenceService's name (the CRD's root rules), or None."""
    for rule in NAME_RULES:
        if not rule.check(name):
            return f"{rule.message} (got {name!r})"
    return None


class InvalidService(ValueError):
    """An InferenceService the API server's schema and CEL rules would reject."""


def validate_service(name: str, spec: dict[str, Any]) -> InferenceServiceSpec:
    """Everything the CRD checks, in Python: the name rules, the spec's own rules, then the
    rules on both."""
    problem = name_problem(name)
    if problem is not None:
        raise InvalidService(problem)
    try:
        parsed = parse_spec(spec)
    except ValidationError as exc:
        raise InvalidService(readable(exc)) from exc
    for rule in SERVICE_RULES:
        if not rule.check(NamedService(name, parsed)):
            raise InvalidService(rule.message)
    return parsed


def readable(exc: ValidationError) -> str:
    """pydantic's errors as one line: `spec.<field>: <what is wrong>; ...`."""
    parts = []
    for error in exc.errors(include_url=False):
        where = "spec" + "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
        )  # Kubernetes' spelling: spec.lora.adapters[0].path
        parts.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)
