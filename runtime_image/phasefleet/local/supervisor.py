"""The local fleet's restarts: a crashed worker or router is restarted after a back-off, and the
fleet gives up on a slot that keeps crashing (the rule: phasefleet.local.restarts).

`check` is one pass, called by `phasefleet serve`'s loop every half second: crashed processes are
swapped for replacements (a worker leaves the router's file at once; its replacement counts as
starting, for the autoscaler too), and replacements whose back-off is over are started. A
restarted worker rejoins the router once healthy, on a new port. A router restarts on the
fleet's port. One log line per death (the process, its exit code or signal, the next attempt)
and one per restart; `Child.restarts` is each process's count. Not restarted: workers the
autoscaler retired (draining) or cancelled (off the fleet's lists when they exit), and a new
worker's first load (see phasefleet.local.fleet).

The router is restarted rather than taken as the end of the fleet: it holds nothing a restart
loses (its workers come from the fleet's file, its load view and prefix map refill within a
refresh or two), and stopping everything for one crash is the outage this is here to avoid.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phasefleet.local.process import Child
from phasefleet.local.restarts import CrashLoop, RestartConfig, Verdict

if TYPE_CHECKING:
    from phasefleet.local.fleet import Fleet

logger = logging.getLogger("phasefleet.serve")

ROUTER_READY_S = 60.0  # seconds a restarted router gets to answer /health


@dataclass
class Pending:
    child: Child  # the replacement, listed but not started
    at: float  # time.monotonic() when its back-off ends


class Supervisor:
    def __init__(self, fleet: Fleet, config: RestartConfig) -> None:
        self.fleet = fleet
        self.crash_loop = CrashLoop(config)
        self.pending: list[Pending] = []
        self._watchers: list[threading.Thread] = []  # restarted processes' waits for health
        fleet.supervised = True

    def check(self) -> str | None:
        """One pass; returns why the fleet gives up (the serve loop then stops it), or None."""
        now = time.monotonic()
        for dead, replacement in self.fleet.replace_crashed():
            verdict = self.crash_loop.crashed(dead.name, now, dead.served_s(now))
            if verdict.delay_s is None:
                logger.error(
                    "%s died (%s, %s); %d crashes within %gs: giving up",
                    dead.name,
                    dead.exit_description(),
                    _how_long(dead, now),
                    verdict.crashes_in_window,
                    self.crash_loop.config.crash_window_s,
                )
                return self._give_up(dead, verdict, now)
            left = (
                "" if dead is self.fleet.router or dead.ready_at is None else "out of the router; "
            )
            logger.warning(
                "%s died (%s, %s; log %s); %srestart %d in %gs",
                dead.name,
                dead.exit_description(),
                _how_long(dead, now),
                dead.log_path,
                left,
                replacement.restarts,
                verdict.delay_s,
            )
            self.pending.append(Pending(replacement, now + verdict.delay_s))
        for due in [p for p in self.pending if p.at <= now]:
            self.pending.remove(due)
            self._launch(due.child)
        return None

    def _launch(self, child: Child) -> None:
        if not self.fleet.launch(child):
            logger.info("%s not restarted: the autoscaler or a stop took it off", child.name)
            return
        logger.info("restarting %s (restart %d, port %d)", child.name, child.restarts, child.port)
        watch = self._router_ready if child is self.fleet.router else self.fleet.admit
        self._watchers = [w for w in self._watchers if w.is_alive()]
        watcher = threading.Thread(
            target=watch, args=(child,), name=f"restart-{child.name}", daemon=True
        )
        self._watchers.append(watcher)
        watcher.start()

    def _router_ready(self, child: Child) -> None:
        try:
            child.wait_healthy(ROUTER_READY_S)
        except RuntimeError:
            return  # it exited (the next check restarts it) or hangs (the fleet has no router)
        logger.info("router is back (%s; restart %d)", child.url, child.restarts)

    def _give_up(self, dead: Child, verdict: Verdict, now: float) -> str:
        window = self.crash_loop.config.crash_window_s
        return (
            f"giving up: {dead.name} crashed {verdict.crashes_in_window} times within"
            f" {window:g}s (the last: {dead.exit_description()}, {_how_long(dead, now)}), so the"
            f" fleet stops instead of restarting it again; the cause is most likely in its log"
            f" ({dead.log_path}), which ends:\n{dead.log_tail().rstrip()}"
        )


def _how_long(child: Child, now: float) -> str:
    if child.ready_at is not None:
        return f"after {child.served_s(now):.0f}s up"
    started = child.started_at if child.started_at is not None else now
    return f"before it was ready, {now - started:.0f}s after it started"
