"""The pytest checks of bench/gpu_check.py: tests/engine with the engine on the device
(PHASEFLEET_TEST_DEVICE) and tests/models (SmolLM2 served by `phasefleet serve`, from the
carried cache in PHASEFLEET_CACHE), each in its own process, counted from its JUnit XML."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from gpu_report import CheckResult, Status

REPO = Path(__file__).resolve().parents[1]
# --quick: a subset that runs in seconds on a CPU (the engine on CUDA is all the rest)
QUICK_ENGINE = ["tests/engine/test_fast_paths.py", "-k", "graph_batch_sizes or backend_choice"]


@dataclass
class Running:
    name: str
    process: subprocess.Popen[bytes]
    junit: Path
    log: Path


def start(
    name: str,
    device: str,
    quick: bool,
    out: Path,
    smollm2_cache: Path | None,
    smollm2_missing: str,
) -> Running | CheckResult:
    """Starts the pytest run of `name` (its log and JUnit XML in `out`), or returns its result
    when it cannot run here."""
    env = {**os.environ, "PHASEFLEET_TEST_DEVICE": device}
    if name == "engine_tests":
        targets = QUICK_ENGINE if quick else ["tests/engine"]
    elif quick:
        return CheckResult(Status.NOT_APPLICABLE, "--quick runs no SmolLM2 tests")
    elif smollm2_cache is None:
        return CheckResult(Status.NOT_RUN, error=smollm2_missing)
    elif not any((smollm2_cache / "models").glob("*.gguf")):
        why = f"tests/models serves SmolLM2's .gguf too, and {smollm2_cache} has none"
        return CheckResult(Status.NOT_RUN, error=why)
    else:
        targets = ["tests/models"]
        env["PHASEFLEET_CACHE"] = str(smollm2_cache)
    junit, log = out / f"{name}.xml", out / f"{name}.log"
    junit.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={junit}"]
    with log.open("wb") as stream:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Running(name, process, junit, log)


def finish(run: Running) -> CheckResult:
    """The result of a pytest run that has exited: counts and failed tests from its XML."""
    code = run.process.returncode
    tail = run.log.read_text(errors="replace")[-3000:] if run.log.is_file() else ""
    if not run.junit.is_file():
        return CheckResult(Status.FAILED, error=f"pytest exited with {code}, no report:\n{tail}")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed, skipped = [], []
    for suite in ET.parse(run.junit).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in ET.parse(run.junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(test)
        skip = case.find("skipped")
        if skip is not None:
            skipped.append(f"{test}: {skip.get('message', '')}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    data = {
        **counts,
        "passed": passed,
        "exit_code": code,
        "failed": failed,
        "skipped_tests": skipped,
    }
    summary = f"{passed} passed, {len(failed)} failed, {counts['skipped']} skipped"
    if code == 0 and passed > 0:
        return CheckResult(Status.OK, summary, data=data)
    return CheckResult(
        Status.FAILED, summary, error=f"pytest exited with {code}:\n{tail}", data=data
    )
