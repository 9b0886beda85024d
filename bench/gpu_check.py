"""Every GPU claim of the engine in one command of a few minutes, for a lent GPU: the Triton
paged-decode kernel, CUDA-graph decode, the SDPA prefill kernel, bf16 greedy output against
transformers, an 8B-shaped model against the device's roofline, the KV hand-off between two
workers, and tests/engine and tests/models on the device. docs/engine.md ("The GPU check") says
what each check measures; the checks are listed in bench/gpu_report.py.

    .venv/bin/python bench/gpu_check.py --smollm2 .gpu-models    # on the GPU machine
    .venv/bin/python bench/gpu_check.py --device cpu --quick     # the same script, seconds, CPU

The measurements run in one process (bench/gpu_runner.py) that this one supervises: a check
that overruns its limit, or a process that dies (a sticky CUDA error, a crash), costs that check
only; the rest go on in a fresh process. Then both pytest runs, side by side. gpu_check.json and
gpu_check.md are rewritten in --out after every check. Exit code: 0 when every check passed (or
does not apply here), 1 when one failed, 2 when none failed but one did not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import gpu_pytest
from gpu_report import CHECK_NAMES, CHECKS, CheckResult, Report, Status, exit_code

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
BUDGET_S = 470.0  # the whole run, under 8 minutes on one H100
PYTEST_RESERVE_S = 150.0  # of the budget, kept for the pytest runs after the measurements
POLL_S = 0.5
BY_NAME = {c.name: c for c in CHECKS}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="small shapes, short runs (CPU test)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or BENCH / "gpu_check"),
        help="where gpu_check.json, gpu_check.md and the logs go (default: $OUT, else "
        "bench/gpu_check)",
    )
    p.add_argument(
        "--smollm2",
        type=Path,
        default=None,
        help="SmolLM2-135M-Instruct for the real-model checks: a folder holding "
        "smollm2-0.1.2.gguf (and, optionally, the converted folder smollm2-0.1.2/), the .gguf "
        "file, or the converted folder (default: .gpu-models/ if present, else the "
        "PHASEFLEET_CACHE models folder)",
    )
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    p.add_argument(
        "--checks", default=",".join(CHECK_NAMES), help="comma-separated subset (others: not run)"
    )
    p.add_argument("--keep-work", action="store_true", help="keep the scratch folder")
    return p.parse_args()


def find_smollm2(path: Path) -> tuple[Path | None, Path | None]:
    """(the .gguf file, the converted folder) that `path` holds or names, each None if absent."""
    from phasefleet.server.named_models import SMOLLM2

    name = SMOLLM2.folder_name
    if path.is_file() and path.suffix == ".gguf":
        folder = path.parent / name
        return path, folder if (folder / "config.json").is_file() else None
    if (path / "config.json").is_file():
        gguf = path.parent / f"{name}.gguf"
        return (gguf if gguf.is_file() else None), path
    ggufs = [path / f"{name}.gguf"] if (path / f"{name}.gguf").is_file() else []
    ggufs = ggufs or sorted(path.glob("*.gguf"))
    folder = path / name
    return (ggufs[0] if ggufs else None), (folder if (folder / "config.json").is_file() else None)


def smollm2_cache(given: Path | None, work: Path) -> tuple[Path | None, str, dict[str, str]]:
    """A PHASEFLEET_CACHE in `work` whose models/ links SmolLM2's .gguf and converted folder
    (what the project's named-model code looks for), or None and why."""
    from phasefleet.server.named_models import SMOLLM2, models_dir

    places = [given] if given is not None else [REPO / ".gpu-models", models_dir()]
    for place in places:
        gguf, folder = find_smollm2(place) if place.exists() else (None, None)
        if gguf is None and folder is None:
            continue
        models = work / "phasefleet-cache" / "models"
        models.mkdir(parents=True, exist_ok=True)
        found = {}
        if gguf is not None:
            (models / f"{SMOLLM2.folder_name}.gguf").symlink_to(gguf.resolve())
            found["gguf"] = str(gguf)
        if folder is not None:
            (models / SMOLLM2.folder_name).symlink_to(folder.resolve())
            found["folder"] = str(folder)
        return models.parent, "", found
    where = f"in {given}" if given is not None else f"in .gpu-models/ or {models_dir()}"
    why = (
        f"no SmolLM2 {where}: copy ~/.cache/phasefleet/models/{SMOLLM2.folder_name}.gguf into "
        f".gpu-models/ (gitignored), carry it to the GPU machine, pass --smollm2 .gpu-models"
    )
    return None, why, {}


class Supervisor:
    def __init__(self, args: argparse.Namespace, report: Report, work: Path) -> None:
        self.args, self.report, self.work = args, report, work
        self.out: Path = args.out
        self.partial = work / "partial"
        self.log = self.out / "gpu_check.log"
        self.started = time.monotonic()
        self.cache: Path | None = None
        self.missing = ""

    def save(self) -> None:
        self.report.seconds = time.monotonic() - self.started
        self.report.write(self.out)

    def _collect(self, names: list[str]) -> None:
        """Reads the results the measuring process has written since the last call."""
        device = self.partial / "_device.json"
        if not self.report.device and device.is_file():
            self.report.device = json.loads(device.read_text())
        changed = False
        for name in names:
            path = self.partial / f"{name}.json"
            if self.report.results[name].status == Status.PENDING and path.is_file():
                self.report.results[name] = CheckResult.from_json(json.loads(path.read_text()))
                changed = True
        if changed:
            self.save()

    def _running(self, names: list[str]) -> tuple[str, float] | None:
        """The check the measuring process runs now, and when (time.time()) it began."""
        for name in names:
            started = self.partial / f"{name}.started"
            if started.is_file() and self.report.results[name].status == Status.PENDING:
                return name, float(started.read_text() or time.time())
        return None

    def _fail(self, name: str, why: str, since: float) -> None:
        tail = self.log.read_text(errors="replace")[-2000:] if self.log.is_file() else ""
        error = f"{why}; the log's end:\n{tail}"
        self.report.results[name] = CheckResult(
            Status.FAILED, error=error, seconds=time.time() - since
        )
        self.save()

    def measure(self, names: list[str], deadline: float) -> None:
        """Runs `names` in the measuring process, restarting it after a check it lost."""
        remaining = list(names)
        while remaining and time.monotonic() < deadline:
            command = [sys.executable, str(BENCH / "gpu_runner.py"), "--partial", str(self.partial)]
            command += ["--work", str(self.work), "--device", self.args.device]
            command += ["--quick"] if self.args.quick else []
            if self.cache is not None:
                command += ["--smollm2-cache", str(self.cache)]
            command += ["--smollm2-missing", self.missing, *remaining]
            with self.log.open("ab") as log:
                proc = subprocess.Popen(
                    command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            why = None
            while proc.poll() is None and why is None:
                time.sleep(POLL_S)
                self._collect(remaining)
                current = self._running(remaining)
                if current and time.time() - current[1] > BY_NAME[current[0]].limit_s:
                    why = f"stopped after {BY_NAME[current[0]].limit_s:.0f} s, its limit"
                elif time.monotonic() > deadline:
                    why = "stopped: the run's time budget ran out"
            if why is not None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            self._collect(remaining)
            current = self._running(remaining)
            if current is not None:
                self._fail(
                    current[0],
                    why or f"the measuring process exited with {proc.returncode}",
                    current[1],
                )
            elif all(self.report.results[n].status == Status.PENDING for n in remaining):
                for name in remaining:  # it died before starting any check
                    self._fail(
                        name, f"the measuring process exited with {proc.returncode}", time.time()
                    )
            remaining = [n for n in remaining if self.report.results[n].status == Status.PENDING]
        for name in remaining:
            self.report.results[name] = CheckResult(
                Status.NOT_RUN, error=f"the run's time budget ({self.args.budget:.0f} s) ran out"
            )
        self.save()

    def pytest(self, names: list[str], deadline: float) -> None:
        """Both pytest runs at once, each stopped at its limit or the deadline."""
        runs: dict[str, tuple[gpu_pytest.Running, float]] = {}
        for name in names:
            started = gpu_pytest.start(
                name, self.args.device, self.args.quick, self.out, self.cache, self.missing
            )
            if isinstance(started, CheckResult):
                self.report.results[name] = started
            else:
                runs[name] = (started, time.monotonic())
        self.save()
        while runs:
            time.sleep(POLL_S)
            for name, (run, since) in list(runs.items()):
                over = time.monotonic() - since > BY_NAME[name].limit_s
                if run.process.poll() is None and not over and time.monotonic() < deadline:
                    continue
                if run.process.poll() is None:
                    os.killpg(run.process.pid, signal.SIGKILL)
                    run.process.wait()
                    tail = run.log.read_text(errors="replace")[-2000:]
                    result = CheckResult(Status.FAILED, error=f"stopped (limit or budget):\n{tail}")
                else:
                    result = gpu_pytest.finish(run)
                result.seconds = time.monotonic() - since
                self.report.results[name] = result
                del runs[name]
                self.save()


def main() -> int:
    args = parse_args()
    selected = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = set(selected) - set(CHECK_NAMES)
    if unknown:
        raise SystemExit(f"--checks: unknown {sorted(unknown)}; known: {', '.join(CHECK_NAMES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.log").unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    report = Report(
        command=shlex.join(["bench/gpu_check.py", *sys.argv[1:]]),
        started=datetime.now(UTC).isoformat(timespec="seconds"),
        options={"device": args.device, "quick": args.quick, "budget_s": args.budget},
    )
    for name in set(CHECK_NAMES) - set(selected):
        report.results[name] = CheckResult(Status.NOT_RUN, error="not selected (--checks)")
    sup = Supervisor(args, report, work)
    if not args.quick:
        sup.cache, sup.missing, found = smollm2_cache(args.smollm2, work)
        report.options["smollm2"] = found or sup.missing
    sup.save()
    try:
        tests = [n for n in selected if BY_NAME[n].where == "pytest"]
        measured = [n for n in CHECK_NAMES if n in selected and n not in tests]
        reserve = PYTEST_RESERVE_S if tests else 0.0
        sup.measure(measured, sup.started + args.budget - reserve)
        sup.pytest(tests, sup.started + args.budget)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    sup.save()
    print(report.markdown())
    return exit_code(report.results)


if __name__ == "__main__":
    sys.exit(main())
