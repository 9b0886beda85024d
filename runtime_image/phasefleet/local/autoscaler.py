"""`phasefleet serve --autoscale`: the policy's loop over a local fleet.

Every interval the loop reads the fleet's metrics (router and serving workers), asks
`phasefleet.autoscale.policy.decide` for each pool's size and applies it. A scale-up starts
worker processes that join the router once healthy; a scale-down stops workers still loading
first (newest first), then retires the least-loaded serving ones (fewest running requests, then
lowest KV usage) from the router and drains them (SIGTERM: their in-flight streams finish). Loads
and drains run on their own threads, so a slow one never holds up the next decision. Each
decision is one log line; so is each interval without metrics, in which the fleet holds its size.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from phasefleet.autoscale.policy import Decision, PolicyState, ScalingConfig, decide
from phasefleet.autoscale.scrape import ScrapeTargets
from phasefleet.autoscale.signals import MetricsUnavailable, PodLoad, Signals
from phasefleet.local.process import Child

if TYPE_CHECKING:
    from phasefleet.local.fleet import Fleet

logger = logging.getLogger("phasefleet.autoscale")

Decide = Callable[
    [ScalingConfig, Signals | MetricsUnavailable, Mapping[str, int], PolicyState, float], Decision
]


class MetricsSource(Protocol):
    def read(self, now: float) -> Signals: ...


class FleetControl(Protocol):
    """What the loop needs of `phasefleet.local.fleet.Fleet` (a fake in unit tests)."""

    def snapshot(self) -> tuple[dict[str, list[Child]], dict[str, list[Child]]]: ...
    def start_worker(self, pool: str) -> Child: ...
    def admit(self, child: Child) -> bool: ...
    def cancel(self, child: Child) -> None: ...
    def retire(self, child: Child) -> None: ...
    def drain(self, child: Child) -> None: ...


def load_key(child: Child, pods: Mapping[str, PodLoad]) -> tuple[float, float, int]:
    """Sorts the worker to remove first: fewest running requests, then lowest KV usage, then the
    newest (its prefix cache is the coldest). A worker with no sample sorts last."""
    serial = -int(child.name.rsplit("-", 1)[-1]) if child.name[-1:].isdigit() else 0
    load = pods.get(child.name)
    if load is None:
        return (float("inf"), float("inf"), serial)
    return (load.running, load.kv_usage, serial)


class Autoscaler:
    def __init__(
        self,
        fleet: FleetControl,
        source: MetricsSource,
        config: ScalingConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] | None = None,
        decide: Decide = decide,
        refresh_wait: float = 2.0,
    ) -> None:
        self.fleet = fleet
        self.source = source
        self.config = config
        self.clock = clock  # the clock of the source's samples and the policy's `now`
        self._stopping = threading.Event()
        self.sleep = sleep or self._stopping.wait  # between decisions; returns early on stop
        self.decide = decide
        self.refresh_wait = refresh_wait  # seconds the router takes to re-read its worker list
        self.state = PolicyState()
        self.last: Decision | None = None
        self._loop: threading.Thread | None = None
        self._actions: list[threading.Thread] = []  # loads and drains under way

    def start(self) -> None:
        self._loop = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._loop.start()

    def failed(self) -> bool:
        """The loop ended without being stopped (its traceback is on stderr)."""
        return self._loop is not None and not self._loop.is_alive() and not self._stopping.is_set()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the loop (after the decision in progress, if any); loads and drains it started
        go on until the fleet stops them (see `join_actions`)."""
        self._stopping.set()
        if self._loop is not None:
            self._loop.join(timeout)

    def join_actions(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for action in list(self._actions):
            action.join(max(deadline - time.monotonic(), 0.0))

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.step()
            if not self._stopping.is_set():
                self.sleep(self.config.interval_s)

    def step(self) -> Decision:
        """One decision: read, decide, apply."""
        now = self.clock()
        members, starting = self.fleet.snapshot()  # serving, loading
        current = {pool: len(members[pool]) + len(starting[pool]) for pool in members}
        signals: Signals | MetricsUnavailable
        try:
            signals = self.source.read(now)
        except MetricsUnavailable as exc:
            signals = exc
        decision = self.decide(self.config, signals, current, self.state, now)
        self.state, self.last = decision.state, decision
        reason, message = (
            (signals.reason, signals.message)
            if isinstance(signals, MetricsUnavailable)
            else (decision.metrics_reason, decision.metrics_message)
        )
        if not decision.metrics_available and not any(d.changed for d in decision.pools.values()):
            sizes = ", ".join(f"{pool} at {n}" for pool, n in current.items())
            logger.warning(
                "metrics unavailable (%s: %s); the fleet holds its size: %s", reason, message, sizes
            )
            return decision
        if not decision.metrics_available:  # some pools hold, the others are decided
            logger.warning("metrics unavailable (%s: %s)", reason, message)
        for pool, pool_decision in decision.pools.items():
            limited = pool_decision.limited
            extra = f" ({limited})" if limited and limited not in pool_decision.reason else ""
            logger.info("%s%s", pool_decision.reason, extra)
            change = pool_decision.desired - current[pool]
            if change > 0:
                self._scale_up(pool, change)
            elif change < 0:
                load = signals.pools.get(pool) if isinstance(signals, Signals) else None
                pods = load.pods if load is not None else {}
                self._scale_down(pool, -change, members[pool], starting[pool], pods)
        return decision

    def _scale_up(self, pool: str, count: int) -> None:
        for _ in range(count):
            child = self.fleet.start_worker(pool)
            logger.info("%s: starting %s", pool, child.name)
            self._spawn(self._admit, child, f"admit-{child.name}")

    def _scale_down(
        self,
        pool: str,
        count: int,
        serving: list[Child],
        starting: list[Child],
        pods: Mapping[str, PodLoad],
    ) -> None:
        for child in list(reversed(starting))[:count]:
            logger.info("%s: stopping %s before it loaded", pool, child.name)
            self.fleet.cancel(child)
            count -= 1
        for child in sorted(serving, key=lambda c: load_key(c, pods))[: max(count, 0)]:
            load = pods.get(child.name)
            seen = (
                f"{load.running:g} running, KV {load.kv_usage:.2f}" if load else "no metrics sample"
            )
            logger.info("%s: retiring %s (%s) and draining it", pool, child.name, seen)
            self.fleet.retire(child)
            self._spawn(self._drain, child, f"drain-{child.name}")

    def _spawn(self, target: Callable[[Child], None], child: Child, name: str) -> None:
        self._actions = [a for a in self._actions if a.is_alive()]
        action = threading.Thread(target=target, args=(child,), name=name, daemon=True)
        self._actions.append(action)
        action.start()

    def _admit(self, child: Child) -> None:
        try:
            self.fleet.admit(child)
        except RuntimeError as exc:
            logger.error("%s did not start: %s", child.name, exc)

    def _drain(self, child: Child) -> None:
        self._stopping.wait(self.refresh_wait)  # the router stops sending it requests first
        self.fleet.drain(child)


def scrape_targets(fleet: Fleet) -> ScrapeTargets:
    """The router and the serving workers (not those loading or draining), by pool and name."""
    routers = (fleet.router.url,) if fleet.router is not None else ()
    members = fleet.members()
    return ScrapeTargets(
        routers=routers,
        workers={pool: {child.name: child.url for child in cs} for pool, cs in members.items()},
    )
