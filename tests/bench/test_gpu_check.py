"""bench/gpu_check.py runs on a CPU too (--device cpu --quick), so it cannot rot while no GPU is
around: every check ends with a status in the JSON, and a check that breaks costs only itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_check import find_smollm2, smollm2_cache
from gpu_report import CHECK_NAMES, CheckResult, Status, exit_code

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def run(out: Path, *args: str) -> tuple[int, dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.md").read_text().startswith("# GPU check")
    assert done.returncode == report["exit_code"], done.stdout + done.stderr
    return done.returncode, report


def test_quick_cpu_run_gives_every_check_a_status(tmp_path: Path) -> None:
    code, report = run(tmp_path, "--device", "cpu", "--quick")
    checks = report["checks"]
    assert isinstance(checks, dict) and list(checks) == CHECK_NAMES
    statuses = {name: checks[name]["status"] for name in CHECK_NAMES}
    assert code == 0, {n: checks[n].get("error") for n in CHECK_NAMES}
    # what a CPU can check, it checks; what is about CUDA says so
    assert statuses["greedy_bf16_tiny"] == statuses["engine_tests"] == "ok"
    cuda_only = (
        "triton_kernel", "cuda_graphs", "sdpa_prefill", "roofline_8b", "kv_fp8_8b", "kv_handoff",
        "host_kv_8b",
    )  # fmt: skip
    for name in (*cuda_only, "lora_8b", "moe_30b"):
        assert statuses[name] == "n/a", name
        assert checks[name]["summary"] and checks[name]["data"], name
    assert checks["roofline_8b"]["data"]["kv_after_load"]["free_blocks"] > 0
    assert checks["kv_handoff"]["data"]["decode_worker"]["failures"] == 0
    fp8 = checks["kv_fp8_8b"]["data"]
    assert (fp8["auto"]["kv_dtype"], fp8["fp8"]["kv_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert fp8["fp8"]["tokens"] >= fp8["auto"]["tokens"] > 0
    assert checks["host_kv_8b"]["data"]["loaded_equal"] is True
    assert checks["engine_tests"]["data"]["passed"] == 2
    assert checks["lora_8b"]["data"]["decode"][0]["one_adapter_ms"] > 0
    moe = checks["moe_30b"]["data"]
    assert [r["path"] for r in moe["decode"]] == ["sorted"] * 3  # the CPU's path
    one, many = moe["decode"][0], moe["decode"][2]  # B = 1 and 64 over 8 experts, 2 per token
    assert one["experts_read"] == pytest.approx(2) and 7.9 < many["experts_read"] <= 8
    assert moe["active_params"] == moe["outside_params"] + 2 * 2 * moe["expert_params"]


def test_a_run_where_every_check_breaks_still_reports_each(tmp_path: Path) -> None:
    # --device cuda on a machine torch sees no GPU on: each check fails on its own, with why.
    code, report = run(
        tmp_path, "--device", "cuda", "--quick", "--checks", "triton_kernel,engine_tests"
    )
    checks = report["checks"]
    assert isinstance(checks, dict)
    assert code == 1
    assert checks["triton_kernel"]["status"] == "failed"
    assert "no GPU" in checks["triton_kernel"]["error"]
    assert checks["engine_tests"]["status"] == "failed"
    assert checks["roofline_8b"]["status"] == "not run"  # not selected, and says so


def test_exit_code_puts_failed_before_not_run() -> None:
    ok, failed, missing = (CheckResult(s) for s in (Status.OK, Status.FAILED, Status.NOT_RUN))
    na = CheckResult(Status.NOT_APPLICABLE)
    assert exit_code({"a": ok, "b": na}) == 0
    assert exit_code({"a": ok, "b": missing}) == 2
    assert exit_code({"a": failed, "b": missing}) == 1


@pytest.mark.parametrize("given", ["models", "gguf", "folder"])
def test_smollm2_is_found_as_a_cache_folder_a_gguf_or_the_converted_folder(
    tmp_path: Path, given: str
) -> None:
    models = tmp_path / "carried"
    (models / "smollm2-0.1.2").mkdir(parents=True)
    (models / "smollm2-0.1.2" / "config.json").write_text("{}")
    (models / "smollm2-0.1.2.gguf").write_bytes(b"GGUF")
    path = {
        "models": models,
        "gguf": models / "smollm2-0.1.2.gguf",
        "folder": models / "smollm2-0.1.2",
    }[given]
    assert find_smollm2(path) == (models / "smollm2-0.1.2.gguf", models / "smollm2-0.1.2")
    cache, why, found = smollm2_cache(path, tmp_path / "work")
    assert cache is not None and why == "" and set(found) == {"gguf", "folder"}
    assert (cache / "models" / "smollm2-0.1.2" / "config.json").is_file()
    assert (cache / "models" / "smollm2-0.1.2.gguf").read_bytes() == b"GGUF"


def test_missing_smollm2_names_the_fix(tmp_path: Path) -> None:
    cache, why, found = smollm2_cache(tmp_path / "nothing-here", tmp_path / "work")
    assert cache is None and found == {}
    assert "--smollm2" in why and ".gpu-models" in why
