"""The search behind `phasefleet plan` on small synthetic traces, and the command end to end:
its table, its exit status and an InferenceService the operator's own validation accepts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from phasefleet.api.names import validate_service
from phasefleet.cli import main
from phasefleet.plan.curves import Curves
from phasefleet.plan.search import Shape, Slo, replay, search
from phasefleet.plan.trace import Trace, from_arrays


def curves(**overrides: float) -> Curves:
    """1 ms per prompt token, 20 ms a decode step (+1 ms per request in the batch)."""
    base = Curves(
        name="test",
        prefill=(0.0, 0.001, 0.0),
        decode=(0.02, 0.001, 0.0),
        kv_capacity_tokens=1_000_000,
        max_num_seqs=64,
        startup_s=0.0,
        handoff_bytes_per_s=1e12,
        kv_bytes_per_token=1,
    )
    return Curves(**{**base.__dict__, **overrides})


def steady(rate: float, seconds: float, prompt: int, output: int) -> Trace:
    n = int(rate * seconds)
    arrival = np.arange(n) / rate
    return from_arrays("steady", arrival, np.full(n, prompt), np.full(n, output))


def test_one_request_alone_is_scored_with_its_own_latencies() -> None:
    trace = from_arrays("one", np.array([0.0]), np.array([100]), np.array([11]))
    slo = Slo(ttft_s=0.2, tpot_s=0.03, percentile=0.99)
    out = replay(trace, curves(), Shape("aggregated", 2048, workers=1), slo)
    assert out.ttft_p == pytest.approx(0.1)  # its prefill, in one step
    assert out.tpot_p == pytest.approx(0.021, abs=0.001)
    assert out.attainment == 1.0


def test_light_load_needs_one_aggregated_worker_and_the_plan_says_so() -> None:
    trace = steady(rate=1.0, seconds=120, prompt=100, output=20)
    plan = search(trace, curves(), Slo(0.5, 0.05, 0.99), max_gpus=8, context=4096)
    assert plan.best is not None and plan.best.shape.gpus == 1
    assert plan.best.shape.mode == "aggregated"


def test_more_load_needs_more_gpus_and_the_cheapest_meeting_fleet_wins() -> None:
    light = steady(rate=2.0, seconds=120, prompt=400, output=50)
    heavy = steady(rate=8.0, seconds=120, prompt=400, output=50)
    slo = Slo(ttft_s=1.0, tpot_s=0.06, percentile=0.95)
    few = search(light, curves(), slo, max_gpus=16, context=4096)
    many = search(heavy, curves(), slo, max_gpus=16, context=4096)
    assert few.best is not None and many.best is not None
    assert many.best.shape.gpus > few.best.shape.gpus
    cheapest = min(c.shape.gpus for c in many.candidates if c.meets(slo))
    assert many.best.shape.gpus == cheapest
    assert {c.shape.mode for c in many.candidates} == {"aggregated", "disaggregated"}


def test_an_slo_no_fleet_can_meet_leaves_no_plan() -> None:
    trace = steady(rate=1.0, seconds=60, prompt=1000, output=10)
    plan = search(trace, curves(), Slo(ttft_s=0.5, tpot_s=0.05, percentile=0.99), 4, 4096)
    assert plan.best is None  # a 1000-token prompt alone takes 1 s to prefill
    assert plan.candidates and all(c.attainment < 0.99 for c in plan.candidates)


def write_trace(path: Path, rate: float, seconds: float) -> None:
    n = int(rate * seconds)
    rows = [f"{i / rate:.3f},{300 + (i * 37) % 500},{20 + (i * 11) % 60}" for i in range(n)]
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")


def plan_argv(tmp_path: Path, *extra: str) -> list[str]:
    """`phasefleet plan` on a steady chat trace (20 req/s for 10 min) with a 500 ms TTFT and
    30 ms TPOT target, on L40S GPUs, at most 12."""
    trace = tmp_path / "chat.csv"
    write_trace(trace, rate=20.0, seconds=600)
    argv = ["plan", "--trace", str(trace), "--ttft-ms", "500", "--tpot-ms", "30"]
    return [*argv, "--gpu", "l40s", "--max-gpus", "12", *extra]


def test_the_command_prints_the_candidates_and_writes_a_service_the_crd_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "svc.yaml"
    argv = plan_argv(tmp_path, "--percentile", "0.99", "--name", "chat", "--hf-repo", "org/model")
    assert main([*argv, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| fleet | GPUs | attainment | TTFT p99 | TPOT p99 |" in printed
    assert "aggregated, chunks of 512" in printed and "disaggregated" in printed
    assert f"-> {out}" in printed
    service = yaml.safe_load(out.read_text())
    assert service["kind"] == "InferenceService" and service["metadata"]["name"] == "chat"
    spec = service["spec"]
    parsed = validate_service("chat", spec)  # every rule the CRD enforces
    pools = [p for p in (parsed.worker, parsed.prefill, parsed.decode) if p is not None]
    gpus = sum(p.max_replicas or 0 for p in pools)
    assert spec["autoscaling"] == {"enabled": True, "gpuBudget": gpus}
    assert all(1 <= (p.min_replicas or 0) <= (p.max_replicas or 0) for p in pools)
    assert spec["slo"] == {"ttftMs": 500, "tpotMs": 30, "percentile": 0.99}
    assert spec["model"]["hf"]["repoId"] == "org/model"
    if spec["mode"] == "disaggregated":  # every prompt handed off, as the simulator ran it
        assert parsed.runtime.remote_prefill_min_tokens == 0
    assert parsed.runtime.kv_cache_dtype == "auto" and "kvCacheDtype" not in str(spec)


def test_a_plan_for_a_float8_kv_pool_says_so_and_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "svc.yaml"
    argv = plan_argv(tmp_path, "--kv-cache-dtype", "fp8")
    assert main([*argv, "-o", str(out)]) == 0
    assert "(roofline, float8 KV)" in capsys.readouterr().out
    spec = yaml.safe_load(out.read_text())["spec"]
    assert validate_service("planned", spec).runtime.kv_cache_dtype == "fp8"
    assert main([*argv, "--gpu", "cpu", "--curves", str(tmp_path / "c.json")]) == 2
    assert "--kv-cache-dtype fp8 needs a GPU's roofline" in capsys.readouterr().err


def test_the_command_refuses_bad_input_saying_what_to_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    write_trace(trace, rate=1.0, seconds=30)
    base = ["plan", "--trace", str(trace), "--ttft-ms", "500", "--tpot-ms", "30"]
    assert main([*base, "--percentile", "1.5"]) == 2
    assert "--percentile must be in [0.5, 0.999]" in capsys.readouterr().err
    assert main([*base, "--gpu", "cpu"]) == 2
    assert "--gpu cpu needs --curves" in capsys.readouterr().err
    assert main([*base, "--max-model-len", "64"]) == 2
    assert "longer than --max-model-len 64" in capsys.readouterr().err
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    assert main([*base[:1], "--trace", str(tmp_path / "bad.csv"), *base[3:]]) == 2
    assert "are none of" in capsys.readouterr().err


def test_an_slo_out_of_reach_writes_nothing_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    write_trace(trace, rate=1.0, seconds=30)
    out = tmp_path / "svc.yaml"
    argv = ["plan", "--trace", str(trace), "--ttft-ms", "1", "--tpot-ms", "1", "-o", str(out)]
    assert main(argv) == 1
    assert "no fleet of at most 64 GPUs meets the SLO" in capsys.readouterr().out
    assert not out.exists()
