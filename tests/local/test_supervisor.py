"""The fleet's restarts with real processes that stand in for workers and the router
(tests/local/fake_process.py: they answer /health at once), a real Fleet and Supervisor, and
back-offs of a tenth of a second: what leaves the router's file, what counts as starting, what
comes back, and what is never restarted."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from phasefleet.local import fleet as fleet_module
from phasefleet.local.fleet import Fleet, FleetConfig, free_port
from phasefleet.local.process import Child
from phasefleet.local.restarts import RestartConfig
from phasefleet.local.supervisor import Supervisor

FAKE = Path(__file__).with_name("fake_process.py")
BACKOFF = 0.1  # seconds: the first restart's back-off


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(fleet_module, "PHASEFLEET", [sys.executable, str(FAKE)])
    monkeypatch.setenv("FAKE_CRASH_FILE", str(tmp_path / "crash"))
    config = FleetConfig(
        model=str(model),
        served_model_name="fake",
        port=free_port(),
        pools={"prefill": 1, "decode": 2},
        run_dir=tmp_path / "run",
        drain_timeout=5.0,
    )
    fleet = Fleet(config)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def file_urls(fleet: Fleet, pool: str) -> list[str]:
    return list(json.loads(fleet.members_path.read_text())[pool])


def check_until(
    supervisor: Supervisor, condition: Callable[[], bool], timeout: float = 20.0
) -> str | None:
    """Runs the supervisor's passes until `condition` holds or it gives up; its give-up text."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        gave_up = supervisor.check()
        if gave_up is not None:
            return gave_up
        time.sleep(0.02)
    return None


def kill(child: Child) -> None:
    assert child.popen is not None
    os.kill(child.popen.pid, signal.SIGKILL)
    child.popen.wait()


def test_a_killed_worker_leaves_the_file_at_once_and_rejoins_after_its_back_off(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="phasefleet.serve")
    supervisor = Supervisor(fleet, RestartConfig(first_backoff_s=BACKOFF))
    dead, other = fleet.members()["decode"]
    kill(dead)
    assert supervisor.check() is None
    assert file_urls(fleet, "decode") == [other.url]  # out of the router's file in one pass
    serving, starting = fleet.snapshot()
    assert serving["decode"] == [other]
    [replacement] = starting["decode"]  # what the autoscaler counts: one starting, none missing
    assert (replacement.name, replacement.restarts, replacement.popen) == (dead.name, 1, None)
    assert replacement.port != dead.port
    check_until(supervisor, lambda: len(fleet.members()["decode"]) == 2)
    assert fleet.members()["decode"] == [other, replacement]
    assert file_urls(fleet, "decode") == [other.url, replacement.url]
    assert replacement.running() and fleet.starting_workers()["decode"] == []
    lines = [r.getMessage() for r in caplog.records]
    died = [line for line in lines if line.startswith(f"{dead.name} died")]
    # its uptime is whatever the machine took between the start and the kill: 0 s, or 1 s
    # on a busy one
    assert [re.sub(r"after \d+s up", "after Ns up", line) for line in died] == [
        f"{dead.name} died (killed by SIGKILL, after Ns up; log {dead.log_path});"
        f" out of the router; restart 1 in {BACKOFF:g}s"
    ]
    assert f"restarting {dead.name} (restart 1, port {replacement.port})" in lines
    assert f"{dead.name} joined ({replacement.url}; restart 1)" in lines
    log = dead.log_path.read_text()
    assert f"--- phasefleet serve: restart 1 of {dead.name} ---" in log
    assert replacement.log_tail().startswith(f"--- phasefleet serve: restart 1 of {dead.name}")


def test_a_worker_that_keeps_crashing_backs_off_longer_each_time_then_the_fleet_gives_up(
    fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="phasefleet.serve")
    supervisor = Supervisor(fleet, RestartConfig(first_backoff_s=BACKOFF, max_crashes=4))
    (tmp_path / "crash").write_text("the GPU is gone")  # every start from now on exits with 3
    dead = fleet.members()["decode"][0]
    kill(dead)
    gave_up = check_until(supervisor, lambda: False)
    assert gave_up is not None
    head, tail = gave_up.split("\n", 1)
    assert head == (
        f"giving up: {dead.name} crashed 4 times within 600s (the last: exit code 3, before it"
        " was ready, 0s after it started), so the fleet stops instead of restarting it again;"
        f" the cause is most likely in its log ({dead.log_path}), which ends:"
    )
    assert (
        tail == f"--- phasefleet serve: restart 3 of {dead.name} ---\nfake worker: the GPU is gone"
    )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(dead.name)]
    assert [line.split("); ", 1)[1] for line in lines if " died " in line] == [
        "out of the router; restart 1 in 0.1s",
        "restart 2 in 0.2s",
        "restart 3 in 0.4s",
        "4 crashes within 600s: giving up",
    ]
    # Meanwhile the others served on, in the router's file throughout.
    assert len(file_urls(fleet, "decode")) == 1 and len(file_urls(fleet, "prefill")) == 1


def test_a_restart_the_autoscaler_cancels_while_it_waits_never_starts(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="phasefleet.serve")
    supervisor = Supervisor(fleet, RestartConfig(first_backoff_s=BACKOFF))
    dead = fleet.members()["decode"][0]
    kill(dead)
    supervisor.check()
    [replacement] = fleet.starting_workers()["decode"]
    fleet.cancel(replacement)  # a scale-down stops workers still starting first
    time.sleep(2 * BACKOFF)
    assert supervisor.check() is None
    assert replacement.popen is None and supervisor.pending == []
    assert f"{dead.name} not restarted: the autoscaler or a stop took it off" in caplog.messages
    assert len(fleet.members()["decode"]) == 1 and fleet.starting_workers()["decode"] == []


def test_a_retired_worker_that_exits_is_not_restarted(fleet: Fleet) -> None:
    supervisor = Supervisor(fleet, RestartConfig(first_backoff_s=BACKOFF))
    leaving = fleet.members()["decode"][0]
    fleet.retire(leaving)  # the autoscaler's scale-down: out of the file, about to drain
    kill(leaving)  # dies while it drains
    time.sleep(2 * BACKOFF)
    assert supervisor.check() is None and supervisor.check() is None
    assert fleet.starting_workers()["decode"] == [] and supervisor.pending == []
    fleet.drain(leaving)  # its drain thread still ends normally
    assert fleet.leaving == []


def test_a_crashed_router_restarts_on_the_fleet_port(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="phasefleet.serve")
    supervisor = Supervisor(fleet, RestartConfig(first_backoff_s=BACKOFF))
    dead = fleet.router
    assert dead is not None
    kill(dead)
    supervisor.check()
    assert fleet.router is not dead and fleet.router is not None
    assert (fleet.router.port, fleet.router.restarts) == (dead.port, 1)
    check_until(supervisor, lambda: "router is back" in " ".join(caplog.messages))
    assert fleet.router.healthy()
    assert f"router is back ({fleet.url}; restart 1)" in caplog.messages
    assert [len(ws) for ws in fleet.members().values()] == [1, 2]  # no worker was touched


def test_a_new_workers_failed_first_load_is_reported_not_restarted(
    fleet: Fleet, tmp_path: Path
) -> None:
    supervisor = Supervisor(fleet, RestartConfig(first_backoff_s=BACKOFF))
    (tmp_path / "crash").write_text("no room on the device")
    child = fleet.start_worker("decode")  # the autoscaler's scale-up
    with pytest.raises(RuntimeError, match="exited before it was ready"):
        fleet.admit(child)  # the autoscaler logs it; its next decision asks again
    time.sleep(2 * BACKOFF)
    assert supervisor.check() is None and supervisor.pending == []
    assert fleet.starting_workers()["decode"] == []
