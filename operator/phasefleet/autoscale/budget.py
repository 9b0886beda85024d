"""The GPU budget: when the pools together ask for more GPUs than `gpuBudget`, the extra
replicas go one at a time to the pool furthest over its SLO target."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Ask:
    """One pool's wish under the budget."""

    current: int
    wanted: int
    gpus_per_replica: int
    pressure: float  # the pool's worst signal / target (>1: over target)


def share(budget: int, asks: Mapping[str, Ask]) -> dict[str, int]:
    """Replicas per pool within `budget` GPUs.

    Pools keep what they have (a budget never forces a scale-down) and shrink as asked; each
    extra replica goes to the pool with the highest pressure, which is assumed to fall in
    proportion to the replicas it gets.
    """
    granted = {role: min(a.current, a.wanted) for role, a in asks.items()}
    left = budget - sum(granted[r] * a.gpus_per_replica for r, a in asks.items())
    while True:
        candidates = [
            role
            for role, a in asks.items()
            if granted[role] < a.wanted and a.gpus_per_replica <= left
        ]
        if not candidates:
            return granted

        def pressure_after(role: str) -> float:
            a = asks[role]
            return a.pressure * max(a.current, 1) / max(granted[role], 1)

        role = max(candidates, key=pressure_after)
        granted[role] += 1
        left -= asks[role].gpus_per_replica
