"""The fleet's bookkeeping under the autoscaler's threads: a worker still loading is stopped by
`cancel` or by `stop` (Ctrl-C) and never joins the router; a draining child gets one SIGTERM."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from phasefleet.local.fleet import Fleet, FleetConfig
from phasefleet.local.process import Child
from tests.server.worker_proc import free_port


def make_fleet(model: Path, run_dir: Path) -> Fleet:
    run_dir.mkdir(parents=True, exist_ok=True)
    config = FleetConfig(
        model=str(model),
        served_model_name="tiny",
        port=free_port(),
        pools={"prefill": 1, "decode": 1},
        run_dir=run_dir,
    )
    return Fleet(config)


def admit_in_thread(fleet: Fleet, child: Child) -> tuple[threading.Thread, list[bool]]:
    joined: list[bool] = []
    thread = threading.Thread(target=lambda: joined.append(fleet.admit(child)))
    thread.start()
    return thread, joined


@pytest.mark.parametrize("how", ["cancel", "stop"])
def test_a_worker_stopped_while_loading_never_joins(
    tiny_model: Path, tmp_path: Path, how: str
) -> None:
    fleet = make_fleet(tiny_model, tmp_path)
    child = fleet.start_worker("prefill")
    assert fleet.starting_workers()["prefill"] == [child]
    thread, joined = admit_in_thread(fleet, child)
    time.sleep(0.5)  # it is importing torch and loading the model
    if how == "cancel":
        fleet.cancel(child)
        assert fleet.starting_workers()["prefill"] == []
    else:
        fleet.stop()
    thread.join(60)
    assert joined == [False]  # told to stop: not an error
    assert child.popen is not None and child.popen.poll() is not None
    assert fleet.members() == {"prefill": [], "decode": []}
    assert not (tmp_path / "workers.json").exists()  # the router's list was never written
    if how == "stop":
        with pytest.raises(RuntimeError, match="the fleet is stopping"):
            fleet.start_worker("decode")
    fleet.stop()


def test_terminate_sends_sigterm_once(tmp_path: Path) -> None:
    counts = (
        "import signal, sys, time\n"
        "seen = []\n"
        "signal.signal(signal.SIGTERM, lambda *_: seen.append(1))\n"
        "print('ready', flush=True)\n"
        "deadline = time.monotonic() + 1.5\n"
        "while time.monotonic() < deadline: time.sleep(0.05)\n"
        "print('sigterms', len(seen))\n"
    )
    child = Child("counter", [sys.executable, "-c", counts], 0, tmp_path / "counter.log")
    child.start()
    while "ready" not in child.log_tail():
        time.sleep(0.05)
    child.terminate()
    time.sleep(0.2)
    child.terminate()  # e.g. Ctrl-C's stop() after the autoscaler began this child's drain
    child.wait(10)
    assert "sigterms 1" in child.log_tail()


def test_the_router_gets_the_tpot_target_for_the_decode_workers_phase_boundary(
    tiny_model: Path, tmp_path: Path
) -> None:
    fleet = make_fleet(tiny_model, tmp_path)
    assert "--tpot-target-ms" not in fleet._router_argv()
    fleet.config.tpot_target_ms = 40
    argv = fleet._router_argv()
    assert argv[argv.index("--tpot-target-ms") + 1] == "40"
    for pool in ("decode", "prefill"):  # it comes with each request instead
        assert "--tpot-target-ms" not in fleet._new_worker(pool).argv


def test_the_router_gets_the_ttft_target_for_late_prompts_last(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`phasefleet serve --ttft-ms` gives the target to the router, which sends it with each
    request, not to the workers; a --late-after-ms of the user's own in --router-args comes
    later in the argv, so it wins."""
    fleet = make_fleet(tiny_model, tmp_path)
    assert "--late-after-ms" not in fleet._router_argv()
    fleet.config.late_after_ms = 800
    argv = fleet._router_argv()
    assert argv[argv.index("--late-after-ms") + 1] == "800"
    assert all("--late-after-ms" not in fleet._new_worker(p).argv for p in ("prefill", "decode"))
    fleet.config.router_args = ["--late-after-ms", "500"]
    argv = fleet._router_argv()
    given = [argv[i + 1] for i, flag in enumerate(argv) if flag == "--late-after-ms"]
    assert given == ["800", "500"]  # argparse keeps the last
