"""The pod runner's containers exit as a kubelet reports them (real processes, no cluster):
exit code and reason, the termination message or the log's tail, OOMKilled from a real memory
cgroup, restarts with back-off; a readOnly mount that cannot be written; and its image "pulls"."""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import time
from pathlib import Path

import pytest

from e2e.harness.container import Container
from e2e.harness.images import pull_error, registry
from e2e.harness.memcg import MemoryCgroup, quantity_bytes, remove_cgroup, stray_cgroups
from e2e.harness.podspec import LaunchPlan


def container(tmp_path: Path, script: str, **fields: object) -> Container:
    message_path = tmp_path / "main.termination-log"
    plan = LaunchPlan(
        name="main",
        argv=[sys.executable, "-c", script],
        env={**os.environ, "PHASEFLEET_TERMINATION_LOG": str(message_path)},
        binds=[],
        startup=None,
        readiness=None,
        liveness=None,
        pre_stop_sleep=0,
    )
    return Container(
        plan=plan,
        host="127.0.0.1",
        log_path=tmp_path / "main.log",
        pid_path=tmp_path / "main.pid",
        restart_policy="Always",
        grace_seconds=5,
        message_path=message_path,
        **fields,  # type: ignore[arg-type]
    )


def run_until_exit(c: Container, timeout: float = 60) -> dict:
    c.step(terminating=False)
    deadline = time.monotonic() + timeout
    while c.popen is not None:
        assert time.monotonic() < deadline, "the container did not exit"
        time.sleep(0.05)
        c.step(terminating=False)
    return c.status("img")


WRITES_AND_FAILS = """
import os, sys
from phasefleet.termination import fail
sys.exit(fail("prog", "model folder /models/x does not exist: put the model there", code=2))
"""


def test_an_error_exit_carries_the_termination_message_and_backs_off(tmp_path: Path) -> None:
    now = [1000.0]
    c = container(tmp_path, WRITES_AND_FAILS, clock=lambda: now[0], backoff_base=10.0)
    status = run_until_exit(c)
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    terminated = status["lastState"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (2, "Error")
    assert terminated["message"] == "model folder /models/x does not exist: put the model there"
    assert status["restartCount"] == 0
    now[0] += 9.9
    c.step(terminating=False)
    assert c.popen is None  # still backing off
    now[0] += 0.2
    status = run_until_exit(c)
    assert status["restartCount"] == 1 and status["lastState"]["terminated"]["exitCode"] == 2
    assert c.next_start - now[0] == pytest.approx(20.0, abs=0.5)  # the back-off doubled


def test_a_silent_failure_falls_back_to_the_log_tail(tmp_path: Path) -> None:
    script = "import sys\nfor i in range(200): print('line', i)\nsys.exit('ValueError: why')"
    c = container(tmp_path, script, fallback_to_logs=True)
    (tmp_path / "main.log").write_text("an older run's output\n")
    terminated = run_until_exit(c)["lastState"]["terminated"]
    assert terminated["exitCode"] == 1
    assert terminated["message"].endswith("line 199\nValueError: why")
    assert len(terminated["message"].splitlines()) == 80
    assert "older run" not in terminated["message"]


def test_without_the_fallback_policy_a_silent_failure_has_no_message(tmp_path: Path) -> None:
    terminated = run_until_exit(container(tmp_path, "raise SystemExit(3)"))["lastState"]
    assert "message" not in terminated["terminated"]


def test_a_success_is_completed_and_a_signal_is_128_plus_it(tmp_path: Path) -> None:
    done = run_until_exit(container(tmp_path, "pass"))["lastState"]["terminated"]
    assert (done["exitCode"], done["reason"]) == (0, "Completed")
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    ended = run_until_exit(container(tmp_path, killed))["lastState"]["terminated"]
    assert (ended["exitCode"], ended["reason"]) == (143, "Error")


def test_a_container_over_its_memory_limit_is_oom_killed(tmp_path: Path) -> None:
    probe = MemoryCgroup.create(f"phasefleet-probe-{os.getpid()}", 64 * 2**20)
    if probe is None:
        pytest.skip("this machine gives no writable memory cgroup: limits are not enforced")
    probe.remove()
    grow = "b = bytearray(600 * 2**20)\nprint(len(b))"
    pod = tmp_path / "pod"  # the pods folder is tmp_path
    pod.mkdir()
    c = container(pod, grow, memory_limit=200 * 2**20, cgroup_name=f"phasefleet-test-{os.getpid()}")
    try:
        c.step(terminating=False)
        assert c.cgroup is not None
        folder = c.cgroup.folder
        assert stray_cgroups(tmp_path) == [folder]  # named for a sweep while it runs
        terminated = run_until_exit(c)["lastState"]["terminated"]
        assert (terminated["exitCode"], terminated["reason"]) == (137, "OOMKilled")
        assert c.cgroup is None and not folder.exists()  # removed after the exit
        assert stray_cgroups(tmp_path) == []
    finally:
        c.stop(grace=0)
        c.release()


def test_a_cgroup_left_by_a_dead_runner_is_swept(tmp_path: Path) -> None:
    cgroup = MemoryCgroup.create(f"phasefleet-stray-{os.getpid()}", 64 * 2**20)
    if cgroup is None:
        pytest.skip("this machine gives no writable memory cgroup")
    pod = tmp_path / "pod"
    pod.mkdir()
    (pod / "main.cgroup").write_text(str(cgroup.folder))
    for folder in stray_cgroups(tmp_path):
        remove_cgroup(folder)
    assert not cgroup.folder.exists()


def test_memory_quantities() -> None:
    assert quantity_bytes("2Gi") == 2 * 2**30
    assert quantity_bytes("512M") == 512 * 10**6
    assert quantity_bytes("1.5Gi") == 3 * 2**29
    assert quantity_bytes("1000") == 1000
    with pytest.raises(ValueError, match="not a memory quantity"):
        quantity_bytes("lots")


def test_only_images_from_invalid_registries_fail_to_pull() -> None:
    assert registry("phasefleet/engine:test") == "docker.io"
    assert registry("ghcr.io/phasefleet/engine:0.4") == "ghcr.io"
    assert pull_error("ghcr.io/phasefleet/engine:0.4") is None
    assert pull_error("phasefleet/engine:test") is None
    assert pull_error("registry.invalid:5000/engine:1") == (
        'failed to pull and unpack image "registry.invalid:5000/engine:1": failed to resolve'
        ' reference "registry.invalid:5000/engine:1": dial tcp: lookup registry.invalid:'
        " no such host"
    )


def test_a_read_only_mount_cannot_be_written_by_the_container(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "kept").write_text("model")
    script = (
        "import errno, pathlib, sys\n"
        f"folder = pathlib.Path({str(folder)!r})\n"
        "assert (folder / 'kept').read_text() == 'model'\n"
        "try:\n"
        "    (folder / 'new').write_text('x')\n"
        "except OSError as exc:\n"
        "    sys.exit(100 + exc.errno)\n"
    )
    c = container(tmp_path, script)
    c.plan = dataclasses.replace(c.plan, read_only=[folder])
    status = run_until_exit(c)
    assert status["lastState"]["terminated"]["exitCode"] == 100 + errno.EROFS
    assert not (folder / "new").exists()
    (folder / "new").write_text("x")  # read-only only inside the container


def test_a_writable_mount_inside_a_read_only_one_can_be_written(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    plans = folder / "plans"  # a subPath of the same volume, mounted read-write; made if missing
    folder.mkdir()
    script = (
        "import errno, pathlib, sys\n"
        f"folder = pathlib.Path({str(folder)!r})\n"
        "(folder / 'plans' / 'written').write_text('plan')\n"
        "try:\n"
        "    (folder / 'new').write_text('x')\n"
        "except OSError as exc:\n"
        "    sys.exit(100 + exc.errno)\n"
    )
    c = container(tmp_path, script)
    c.plan = dataclasses.replace(c.plan, read_only=[folder], writable=[plans])
    status = run_until_exit(c)
    assert status["lastState"]["terminated"]["exitCode"] == 100 + errno.EROFS
    assert (plans / "written").read_text() == "plan"
    assert not (folder / "new").exists()
