"""The autoscaler's loop over a fake fleet, a fake metrics source and a hand-moved clock, with
the real policy (`decide`)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from phasefleet.autoscale.demand import BUSY_TARGET
from phasefleet.autoscale.policy import PoolLimits, ScalingConfig
from phasefleet.autoscale.signals import MetricsUnavailable, PodLoad, PoolSignals, Signals
from phasefleet.local.autoscaler import Autoscaler
from phasefleet.local.process import Child

INTERVAL = 10.0
WINDOW = 30.0  # scale-down stabilization (seconds)


def make_config() -> ScalingConfig:
    return ScalingConfig(
        pools={"prefill": PoolLimits(1, 3), "decode": PoolLimits(1, 2)},
        ttft_s=0.1,
        interval_s=INTERVAL,
        scale_down_stabilization_s=WINDOW,
        max_step=2,
        startup_s=WINDOW / 2,  # no scale-down within a start-up of a scale-up
        peak_headroom=1.0,
    )


def worker(name: str) -> Child:
    return Child(name, argv=[], port=0, log_path=Path("/dev/null"))


class FakeFleet:
    """Keeps the lists a Fleet keeps; loads and drains finish when the test says so."""

    def __init__(self, prefill: int, decode: int = 1) -> None:
        self.serving = {
            "prefill": [worker(f"prefill-{i}") for i in range(prefill)],
            "decode": [worker(f"decode-{i}") for i in range(decode)],
        }
        self.starting: dict[str, list[Child]] = {"prefill": [], "decode": []}
        self.serial = 10
        self.loaded = threading.Event()  # set: every starting worker becomes healthy
        self.drains_may_end = threading.Event()
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def members(self) -> dict[str, list[Child]]:
        with self.lock:
            return {pool: list(ws) for pool, ws in self.serving.items()}

    def snapshot(self) -> tuple[dict[str, list[Child]], dict[str, list[Child]]]:
        with self.lock:
            starting = {pool: list(ws) for pool, ws in self.starting.items()}
            return {pool: list(ws) for pool, ws in self.serving.items()}, starting

    def start_worker(self, pool: str) -> Child:
        with self.lock:
            child = worker(f"{pool}-{self.serial}")
            self.serial += 1
            self.starting[pool].append(child)
            self.events.append(("start", child.name))
            return child

    def admit(self, child: Child) -> bool:
        self.loaded.wait(10)
        with self.lock:
            pool = child.name.split("-")[0]
            if child not in self.starting[pool]:
                return False
            self.starting[pool].remove(child)
            self.serving[pool].append(child)
            self.events.append(("joined", child.name))
            return True

    def cancel(self, child: Child) -> None:
        with self.lock:
            self.starting[child.name.split("-")[0]].remove(child)
            self.events.append(("cancel", child.name))

    def retire(self, child: Child) -> None:
        with self.lock:
            self.serving[child.name.split("-")[0]].remove(child)
            self.events.append(("retire", child.name))

    def drain(self, child: Child) -> None:
        self.drains_may_end.wait(10)
        with self.lock:
            self.events.append(("drained", child.name))

    def names(self, pool: str) -> list[str]:
        return [c.name for c in self.members()[pool]]


class FakeSource:
    """Signals from the fake fleet's serving workers, with loads the test sets."""

    def __init__(self, fleet: FakeFleet) -> None:
        self.fleet = fleet
        self.ttft_s: float | None = None
        self.busy = 0.1
        self.pods: dict[str, PodLoad] = {}
        self.down: MetricsUnavailable | None = None

    def read(self, now: float) -> Signals:
        if self.down is not None:
            raise self.down
        members = self.fleet.members()

        def pool(name: str) -> PoolSignals:
            ws = members[name]
            return PoolSignals(
                reporting=len(ws),
                busy_fraction=self.busy,
                prefill_backlog_tokens=0.0,
                kv_usage_sum=0.1 * len(ws),
                running=0.0,
                waiting=0.0,
                pods={w.name: self.pods.get(w.name, PodLoad()) for w in ws},
            )

        return Signals(
            sampled_at=now,
            window_s=INTERVAL,
            pools={"prefill": pool("prefill"), "decode": pool("decode")},
            ttft_s=self.ttft_s,
        )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        time.sleep(0.005)  # let the test's thread run


def make_autoscaler(fleet: FakeFleet, source: FakeSource, clock: FakeClock) -> Autoscaler:
    return Autoscaler(
        fleet, source, make_config(), clock=clock, sleep=clock.sleep, refresh_wait=0.0
    )


def wait_for(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_ttft_over_target_starts_workers_that_count_while_loading(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="phasefleet.autoscale")
    fleet, clock = FakeFleet(prefill=1), FakeClock()
    source = FakeSource(fleet)
    autoscaler = make_autoscaler(fleet, source, clock)
    source.ttft_s, source.busy = 0.5, BUSY_TARGET  # 5x the 100 ms target on a loaded pool

    decision = autoscaler.step()  # a latency term asks for a quarter more at most: 1 -> 2
    assert (decision.pools["prefill"].current, decision.pools["prefill"].desired) == (1, 2)
    assert decision.pools["decode"].desired == 1
    assert fleet.events == [("start", "prefill-10")]
    assert fleet.names("prefill") == ["prefill-0"]  # not in the router's list while loading

    clock.now += INTERVAL
    again = autoscaler.step()  # still loading: current counts it, so nothing more starts
    assert again.pools["prefill"].current == 2
    assert [e for e in fleet.events if e[0] == "start"] == fleet.events[:1]

    fleet.loaded.set()
    wait_for(lambda: len(fleet.names("prefill")) == 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "phasefleet.autoscale"]
    assert any(line.startswith("prefill 1->2: TTFT p90 500 ms > target 100 ms") for line in lines)
    assert any(line.startswith("decode stays at 1") for line in lines)
    assert "prefill: starting prefill-10" in lines


def test_scale_down_after_the_window_drains_the_least_loaded_worker_without_blocking() -> None:
    fleet, clock = FakeFleet(prefill=3), FakeClock()
    source = FakeSource(fleet)
    source.busy = BUSY_TARGET / 2  # 3 workers half as busy as the target: 2 would do
    source.pods = {
        "prefill-0": PodLoad(running=2, kv_usage=0.05),
        "prefill-1": PodLoad(running=0, kv_usage=0.3),
        "prefill-2": PodLoad(running=0, kv_usage=0.1),
    }
    autoscaler = make_autoscaler(fleet, source, clock)
    start = clock.now
    decision = autoscaler.step()
    while decision.pools["prefill"].desired == 3:
        # a whole window of lower asks first, then the size before them lets go over the tail
        assert clock.now - start <= 2 * WINDOW, "no scale-down after the window and its tail"
        clock.now += INTERVAL
        decision = autoscaler.step()
    assert clock.now - start > WINDOW
    assert (decision.pools["prefill"].current, decision.pools["prefill"].desired) == (3, 2)
    assert fleet.events == [("retire", "prefill-2")]  # idle, and the lower KV usage of the two
    assert fleet.names("prefill") == ["prefill-0", "prefill-1"]

    # The drain is still running: the next decision neither waits for it nor counts the worker.
    clock.now += INTERVAL
    assert autoscaler.step().pools["prefill"].current == 2
    assert ("drained", "prefill-2") not in fleet.events
    fleet.drains_may_end.set()
    autoscaler.join_actions(5.0)
    assert fleet.events == [("retire", "prefill-2"), ("drained", "prefill-2")]


def test_scale_down_stops_a_worker_still_loading_before_a_serving_one() -> None:
    fleet, clock = FakeFleet(prefill=1), FakeClock()
    source = FakeSource(fleet)
    autoscaler = make_autoscaler(fleet, source, clock)
    source.ttft_s, source.busy = 0.15, BUSY_TARGET  # 1.5x target on a loaded pool: one more
    autoscaler.step()
    assert fleet.events == [("start", "prefill-10")]
    source.ttft_s, source.busy = None, 0.1  # the burst is over before it loaded
    start = clock.now
    while not any(e[0] == "cancel" for e in fleet.events):
        clock.now += INTERVAL
        assert clock.now - start <= 2 * WINDOW + 2 * INTERVAL  # the window and its tail
        autoscaler.step()
    assert fleet.events == [("start", "prefill-10"), ("cancel", "prefill-10")]
    assert fleet.names("prefill") == ["prefill-0"]
    fleet.loaded.set()
    autoscaler.join_actions(5.0)
    assert fleet.names("prefill") == ["prefill-0"]


def test_unavailable_metrics_hold_every_pool_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="phasefleet.autoscale")
    fleet, clock = FakeFleet(prefill=3, decode=2), FakeClock()
    source = FakeSource(fleet)
    source.down = MetricsUnavailable("ScrapeFailed", "No worker answered GET /metrics")
    autoscaler = make_autoscaler(fleet, source, clock)
    for _ in range(int(3 * WINDOW / INTERVAL)):  # idle fleet, but no metrics: no scale-down
        decision = autoscaler.step()
        assert not decision.metrics_available
        assert {p: d.desired for p, d in decision.pools.items()} == {"prefill": 3, "decode": 2}
        clock.now += INTERVAL
    assert fleet.events == []
    lines = [r.getMessage() for r in caplog.records if r.name == "phasefleet.autoscale"]
    assert len(lines) == int(3 * WINDOW / INTERVAL)  # one line per interval, not one per pool
    assert lines[0] == (
        "metrics unavailable (ScrapeFailed: No worker answered GET /metrics);"
        " the fleet holds its size: prefill at 3, decode at 2"
    )


def test_stop_ends_the_loop_and_no_decision_follows() -> None:
    fleet, clock = FakeFleet(prefill=1), FakeClock()
    source = FakeSource(fleet)
    reads: list[float] = []
    read = source.read

    def counted(now: float) -> Signals:
        reads.append(now)
        return read(now)

    source.read = counted  # type: ignore[method-assign]
    autoscaler = make_autoscaler(fleet, source, clock)
    autoscaler.start()
    wait_for(lambda: len(reads) >= 3)
    autoscaler.stop(5.0)
    assert not autoscaler.failed()
    done = len(reads)
    time.sleep(0.1)
    assert len(reads) == done
    assert reads == [1000.0 + INTERVAL * i for i in range(done)]  # one decision per interval


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_loop_is_reported_as_failed() -> None:
    fleet, clock = FakeFleet(prefill=1), FakeClock()
    source = FakeSource(fleet)
    autoscaler = make_autoscaler(fleet, source, clock)
    fleet.snapshot = lambda: ({}, {})  # type: ignore[method-assign]  # a bug: pools vanish
    autoscaler.start()
    wait_for(autoscaler.failed)
