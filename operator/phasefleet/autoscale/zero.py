"""Scale to zero and back: applied to the policy's desired sizes, for pools with minReplicas 0.

A pool whose minReplicas is 0 keeps at least one replica until the whole service has been idle
(no request running, waiting, or held at the router) for `scale_to_zero_after_s`; then it goes
to zero. A pool at zero wakes, to one replica at once, as soon as the router holds a request
for any pool of the service (disaggregated services wake both pools: each has a part in every
request). Pure, like `policy.decide`: the caller passes `now` and keeps `busy_at`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from phasefleet.autoscale.signals import Signals


@dataclass(frozen=True)
class ZeroStep:
    desired: dict[str, int]  # by pool, after this step
    reasons: dict[str, str]  # by pool, the sentence of each size this step changed
    busy_at: float  # when a request was last seen anywhere in the service


def to_and_from_zero(
    min_replicas: Mapping[str, int],  # by pool
    after_s: float,  # spec.autoscaling.scaleToZeroAfterSeconds
    signals: Signals,
    current: Mapping[str, int],
    desired: Mapping[str, int],
    busy_at: float | None,  # None: first decision, the idle window starts now
    now: float,
) -> ZeroStep:
    held = sum(signals.held.values())
    busy_at = now if signals.busy or busy_at is None else busy_at
    idle_s = now - busy_at
    out = dict(desired)
    reasons: dict[str, str] = {}
    for role, floor in min_replicas.items():
        if floor > 0:
            continue
        size, want = current.get(role, 0), desired.get(role, 0)
        if want < 1 and (held > 0 or signals.busy):
            out[role] = 1
            why = f"the router holds {held:g} requests" if held else "the service has requests"
            reasons[role] = f"{_move(role, size, 1)}: {why} (wake from zero)"
        elif want < 1 and size > 0 and idle_s < after_s:
            out[role] = 1
            reasons[role] = (
                f"{_move(role, size, 1)}: idle {idle_s:.0f} s of the {after_s:.0f} s before zero"
            )
        elif idle_s >= after_s and (want > 0 or size > 0):
            out[role] = 0
            reasons[role] = f"{_move(role, size, 0)}: no request for {idle_s:.0f} s (scale to zero)"
    return ZeroStep(out, reasons, busy_at)


def _move(role: str, size: int, to: int) -> str:
    return f"{role} stays at {to}" if size == to else f"{role} {size}->{to}"
