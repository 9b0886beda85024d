"""The CPU linears: row buckets, results against F.linear, the path chosen per shape and row
bucket from injected timings (nothing here times anything), the plans' cache, and an engine
whose plans mix both paths against transformers."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phasefleet.api.contract import CPU_LINEAR_CACHE_ENV
from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.models import cpu_linear, linear_plan
from phasefleet.engine.models.cpu_linear import (
    EXACT_ROWS,
    CpuLinear,
    choose_cpu_linear,
    pack_linears,
    padded_rows,
    plan_key,
)
from phasefleet.engine.models.linear_plan import (
    ROUNDS,
    LinearPlan,
    Measure,
    PlanCache,
    calibrate,
)
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import random_prompts

CPU = torch.device("cpu")
ROWS = (1, 2, 4, 8, 16)


def plan(onednn_ms: list[float], torch_ms: list[float], rows: tuple[int, ...] = ROWS) -> LinearPlan:
    return LinearPlan(rows, tuple(t / 1e3 for t in onednn_ms), tuple(t / 1e3 for t in torch_ms))


# F.linear wins at 1-2 rows, oneDNN from 4 rows on: a plan that uses both paths, switching
# halfway between 2 and 4 rows.
MIXED = plan([1.0, 1.0, 1.0, 1.0, 1.0], [0.5, 0.8, 2.0, 3.0, 4.0])


class FakeMeasure:
    """measure(path, rows) from a table of milliseconds, recording the calls."""

    def __init__(self, onednn_ms: dict[int, list[float]], torch_ms: dict[int, list[float]]):
        self.ms = {"onednn": onednn_ms, "torch": torch_ms}  # rows -> one value per round
        self.calls: list[tuple[str, int]] = []

    def __call__(self, path: str, rows: int) -> float:
        n = sum(1 for c in self.calls if c == (path, rows))
        self.calls.append((path, rows))
        return self.ms[path][rows][n] / 1e3


def test_padded_rows_are_exact_when_small_and_within_an_eighth_above() -> None:
    assert [padded_rows(r) for r in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    assert [padded_rows(r) for r in (17, 18, 19, 33, 65, 100, 2048, 2049)] == [
        18,
        18,
        20,
        36,
        72,
        104,
        2048,
        2304,
    ]
    for rows in range(1, 9000):
        padded = padded_rows(rows)
        assert rows <= padded < rows * 1.125 + 1
        assert padded_rows(padded) == padded  # a bucket pads to itself


def test_row_counts_up_to_2048_fall_in_few_buckets() -> None:
    # oneDNN caches 1024 primitives; 5 weight shapes x these buckets must fit with room to spare.
    assert len({padded_rows(r) for r in range(1, 2049)}) <= 80


# --- the choice, from injected timings --------------------------------------------------------


def test_the_faster_path_is_chosen_below_and_above_one_switch() -> None:
    assert [MIXED.path_at(r) for r in (1, 2, 3, 4, 8, 16)] == ["torch"] * 3 + ["onednn"] * 3
    assert MIXED.path_at(1000) == "onednn"  # above the last row count: its choice holds
    assert MIXED.paths() == {"torch", "onednn"}
    assert MIXED.describe() == "torch 1-3, onednn 4+"
    # The other way round: oneDNN for small steps, F.linear from halfway between 4 and 8 rows.
    late = plan([1.0, 1.0, 1.0, 2.0, 4.0], [2.0, 2.0, 2.0, 1.0, 1.0])
    assert late.describe() == "onednn 1-6, torch 7+"
    assert plan([2.0, 1.0, 1.0, 1.0, 1.0], [1.0] + [2.0] * 4).describe() == "torch 1, onednn 2+"


def test_one_path_throughout_unless_switching_saves_enough() -> None:
    # One slow oneDNN timing in the middle (outside load) does not make a switch.
    assert plan([1.0, 1.0, 1.25, 1.0, 1.0], [2.0, 2.0, 1.0, 2.0, 2.0]).describe() == "onednn 1+"
    # F.linear 5% faster at 1 row: not worth a second weight copy; 25% faster: it is.
    assert plan([1.0] * 5, [0.95] + [2.0] * 4).paths() == {"onednn"}
    assert plan([1.0] * 5, [0.8] + [2.0] * 4).paths() == {"onednn", "torch"}
    assert plan([2.0] * 5, [1.0] * 5).describe() == "torch 1+"
    assert plan([1.0] * 5, [1.0] * 5).describe() == "onednn 1+"  # ties: oneDNN


def test_a_plan_rejects_mismatched_timings() -> None:
    with pytest.raises(ValueError, match="equal, non-empty"):
        LinearPlan((1, 2), (1.0,), (1.0, 2.0))
    with pytest.raises(ValueError, match="ascending, distinct"):
        LinearPlan((2, 1), (1.0, 1.0), (1.0, 1.0))


def test_calibration_alternates_the_paths_and_keeps_each_best() -> None:
    # A burst of load in round 1 hits torch at 1 row; round 2 shows its real speed.
    measure = FakeMeasure(
        onednn_ms={1: [2.0, 2.1, 2.2], 8: [1.0, 1.2, 1.1]},
        torch_ms={1: [9.0, 0.5, 0.6], 8: [3.0, 3.0, 3.1]},
    )
    p = calibrate(measure, rows=(1, 8), rounds=3)
    assert p == plan([2.0, 1.0], [0.5, 3.0], rows=(1, 8))
    assert measure.calls[:4] == [("onednn", 1), ("torch", 1), ("onednn", 8), ("torch", 8)]
    assert measure.calls[4:8] == [("torch", 1), ("onednn", 1), ("torch", 8), ("onednn", 8)]
    assert len(measure.calls) == 12


def constant(onednn_ms: float, torch_ms: float) -> Measure:
    return lambda path, rows: (onednn_ms if path == "onednn" else torch_ms) / 1e3


def test_plans_are_cached_in_memory_and_in_a_file(tmp_path: Path) -> None:
    file = tmp_path / "sub" / "plans.json"
    first = PlanCache(file, {})
    measure = FakeMeasure({r: [1.0] * 3 for r in ROWS}, {r: [2.0] * 3 for r in ROWS})
    p = first.get("k", measure, rows=ROWS)
    timed = 2 * ROUNDS * len(ROWS)
    assert p.paths() == {"onednn"} and len(measure.calls) == timed
    assert first.get("k", measure, rows=ROWS) == p and len(measure.calls) == timed  # memory
    other = first.get("k2", constant(2.0, 1.0), rows=ROWS)
    # A new process (empty memory) reads both from the file and times nothing.
    later = PlanCache(file, {})
    assert later.get("k", constant(9.0, 9.0), rows=ROWS) == p
    assert later.get("k2", constant(9.0, 9.0), rows=ROWS) == other
    # Other calibration rows than stored: timed again.
    again = later.get("k", constant(3.0, 1.0), rows=(1, 2))
    assert again == plan([3.0, 3.0], [1.0, 1.0], rows=(1, 2))
    assert set(json.loads(file.read_text())) == {"k", "k2"}


def test_a_broken_plans_file_is_timed_over_and_no_file_is_written_without_one(
    tmp_path: Path,
) -> None:
    file = tmp_path / "plans.json"
    file.write_text("{not json")
    p = PlanCache(file, {}).get("k", constant(1.0, 2.0), rows=ROWS)
    assert p.paths() == {"onednn"}
    assert set(json.loads(file.read_text())) == {"k"}
    file.write_text(json.dumps({"k": {"rows": [1]}, "j": 3}))  # bad entries are dropped
    assert PlanCache(file, {}).get("k", constant(2.0, 1.0), rows=ROWS).paths() == {"torch"}
    assert set(json.loads(file.read_text())) == {"k"}
    PlanCache(None, {}).get("k", constant(1.0, 2.0), rows=ROWS)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["plans.json", "plans.json.lock", "plans.json.timing"]


def test_plans_written_at_once_by_processes_sharing_the_file_are_all_kept(
    tmp_path: Path,
) -> None:
    """Pods on several nodes share one plans file (a model cache): each adds its own keys."""
    file = tmp_path / "plans.json"
    code = (
        "import sys; from pathlib import Path\n"
        "from phasefleet.engine.models.linear_plan import PlanCache\n"
        "cache = PlanCache(Path(sys.argv[1]), {})\n"
        "for k in range(20):\n"
        "    cache.get(f'{sys.argv[2]}{k}', lambda path, rows: 1.0, rows=(1, 2))\n"
        "assert cache.timed == 20\n"
    )
    runs = [
        subprocess.Popen([sys.executable, "-c", code, str(file), who]) for who in ("a", "b", "c")
    ]
    assert [r.wait(timeout=120) for r in runs] == [0, 0, 0]
    keys = set(json.loads(file.read_text()))
    assert keys == {f"{who}{k}" for who in "abc" for k in range(20)}
    later = PlanCache(file, {})
    later.get("a3", constant(9.0, 9.0), rows=(1, 2))
    assert later.timed == 0  # read, not timed


def test_processes_starting_together_time_each_shape_once(tmp_path: Path) -> None:
    """Pods of one kind of node starting at once: one times a shape, the others read it."""
    file = tmp_path / "plans.json"
    code = (
        "import sys, time; from pathlib import Path\n"
        "from phasefleet.engine.models.linear_plan import PlanCache\n"
        "cache = PlanCache(Path(sys.argv[1]), {})\n"
        "slow = lambda path, rows: time.sleep(0.05) or 1.0\n"
        "for k in range(12):\n"
        "    cache.get(f'shape{k}', slow, rows=(1, 2))\n"
        "print(cache.timed)\n"
    )
    runs = [
        subprocess.Popen([sys.executable, "-c", code, str(file)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    timed = [int(r.communicate(timeout=120)[0]) for r in runs]
    assert [r.returncode for r in runs] == [0, 0, 0]
    assert sum(timed) == 12, timed  # each shape once, by whichever process got to it first
    assert set(json.loads(file.read_text())) == {f"shape{k}" for k in range(12)}


def test_a_timing_lock_held_too_long_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(linear_plan, "TIMING_WAIT_S", 0.2)
    cache = PlanCache(tmp_path / "plans.json", {})
    path = cache.timing_lock("k")
    assert path is not None
    path.parent.mkdir()
    with path.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process, stuck while timing "k"
        plan = cache.get("k", constant(1.0, 2.0), rows=ROWS)
    assert plan.paths() == {"onednn"} and cache.timed == 1
    assert "held over 0.2 s: timing it here" in caplog.text


def test_a_timing_lock_that_cannot_be_made_still_times_and_keeps_the_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = tmp_path / "plans.json"
    file.with_name("plans.json.timing").write_text("")  # a file where the lock folder goes
    cache = PlanCache(file, {})
    assert cache.get("k", constant(1.0, 2.0), rows=ROWS).paths() == {"onednn"}
    assert cache.timed == 1 and set(json.loads(file.read_text())) == {"k"}
    assert "timing CPU linear plans without a lock" in caplog.text


def test_a_filesystem_without_locks_still_times_and_keeps_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_locks(fd: object, op: int) -> None:
        if op & fcntl.LOCK_NB:  # the timing lock; the file's own write lock still works
            raise OSError(37, "No locks available")

    monkeypatch.setattr(linear_plan.fcntl, "flock", no_locks)
    cache = PlanCache(tmp_path / "plans.json", {})
    assert cache.get("k", constant(1.0, 2.0), rows=ROWS).paths() == {"onednn"}
    assert cache.timed == 1 and "timing CPU linear plans without a lock" in caplog.text


def test_the_key_names_what_a_timing_depends_on() -> None:
    key = plan_key(torch.empty(96, 64, dtype=torch.bfloat16), has_bias=True)
    assert f"torch {torch.__version__}|" in key
    assert f"|threads {torch.get_num_threads()}|torch.bfloat16|96x64|bias True" in key


# --- the modules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 17, 100])
@pytest.mark.parametrize("which", ["onednn", "mixed"])
def test_cpu_linear_matches_f_linear(
    dtype: torch.dtype, tol: float, bias: bool, rows: int, which: str
) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    got = CpuLinear(weight, b, None if which == "onednn" else MIXED)(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_cpu_linear_holds_the_weight_copies_its_plan_uses() -> None:
    weight = torch.randn(32, 16)
    both = CpuLinear(weight, None, MIXED)
    assert both.packed is not None and both.weight is not None
    assert both.weight.data_ptr() == weight.data_ptr()  # shared, not copied
    torch_only = CpuLinear(weight, None, plan([2.0] * 5, [1.0] * 5))
    assert torch_only.packed is None and torch_only.weight is not None
    onednn_only = CpuLinear(weight, None, plan([1.0] * 5, [2.0] * 5))
    assert onednn_only.packed is not None and onednn_only.weight is None
    assert CpuLinear(weight, None).weight is None  # no plan: oneDNN throughout


def test_cpu_linear_takes_a_non_contiguous_input() -> None:
    weight = torch.randn(32, 16)
    x = torch.randn(16, 6).t()  # [6, 16], transposed view
    torch.testing.assert_close(CpuLinear(weight, None)(x), F.linear(x, weight))
    torch.testing.assert_close(CpuLinear(weight, None, MIXED)(x[:1]), F.linear(x[:1], weight))


@pytest.fixture
def fake_timings(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """pack_linears times nothing: every shape gets MIXED's timings at ROWS, no plans file, an
    empty in-process cache. Returns the weight shapes that were 'timed'."""
    timed: list[tuple[int, ...]] = []

    def measure(
        weights: list[torch.Tensor], bias: torch.Tensor | None, model: list[torch.Tensor]
    ) -> Measure:
        timed.append(tuple(weights[0].shape))
        return lambda path, rows: dict(
            zip(ROWS, MIXED.onednn_s if path == "onednn" else MIXED.torch_s, strict=True)
        ).get(rows, 1.0)

    monkeypatch.setattr(cpu_linear, "_measure", measure)
    monkeypatch.setattr(cpu_linear, "_PLANS", {})
    monkeypatch.setattr(cpu_linear, "CALIBRATION_ROWS", ROWS)
    monkeypatch.setenv(CPU_LINEAR_CACHE_ENV, "")
    monkeypatch.delenv("PHASEFLEET_CPU_LINEAR", raising=False)
    return timed


def test_pack_linears_times_each_shape_once_and_replaces_nested_linears_only(
    fake_timings: list[tuple[int, ...]],
) -> None:
    inner = nn.Sequential(nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
    model = nn.Sequential(nn.Linear(8, 8), inner)
    x = torch.randn(3, 8)
    want = model(x)
    summary = pack_linears(model)
    assert sorted(fake_timings) == [(4, 8), (8, 8)]  # 8x8 twice, timed once
    assert summary.startswith("timed per shape (") and "8x8 torch 1-3, onednn 4+" in summary
    assert all(isinstance(m, CpuLinear) for m in (model[0], inner[1], inner[2]))
    assert isinstance(inner[0], nn.ReLU)
    torch.testing.assert_close(model(x), want)
    torch.testing.assert_close(model(x[:1]), want[:1])  # 1 row: the F.linear side
    pack_linears(nn.Linear(8, 8))
    assert len(fake_timings) == 2  # the process's cache


def test_forced_onednn_packs_everything_without_timing(
    fake_timings: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", "onednn")
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(model) == "onednn" and fake_timings == []
    assert isinstance(model[0], CpuLinear) and model[0].weight is None


def test_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHASEFLEET_CPU_LINEAR", raising=False)
    assert choose_cpu_linear(CPU, torch.float32) == "onednn"
    assert choose_cpu_linear(CPU, torch.bfloat16) == "onednn"
    assert choose_cpu_linear(CPU, torch.float16) == "torch"  # not packed: falls back quietly
    assert choose_cpu_linear(torch.device("cuda"), torch.float32) == "torch"
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", "torch")
    assert choose_cpu_linear(CPU, torch.float32) == "torch"
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", "onednn")
    with pytest.raises(ValueError, match="not usable here: dtype torch.float16"):
        choose_cpu_linear(CPU, torch.float16)
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="PHASEFLEET_CPU_LINEAR must be"):
        choose_cpu_linear(CPU, torch.float32)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_an_engine_whose_linears_mix_both_paths_matches_transformers(
    name: str,
    fake_timings: list[tuple[int, ...]],
    tiny_model: Callable[[str], Path],
    hf_greedy: Callable[[str, list[int], int], list[int]],
) -> None:
    # Steps of 1-3 tokens run F.linear, larger ones oneDNN; qwen2: qkv bias, tied head.
    config = EngineConfig(
        model=str(tiny_model(name)),
        device="cpu",
        block_size=4,
        max_num_batched_tokens=24,
        num_kv_blocks=128,
    )
    eng = LLMEngine(config)
    assert "torch 1-3, onednn 4+" in eng.runner.model.linear_backend
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = random_prompts([3, 17, 40, 9], seed=3)
    for prompt, out in zip(prompts, eng.generate(prompts, greedy), strict=True):
        assert out.output_token_ids == hf_greedy(name, prompt, greedy.max_tokens)


def test_small_row_counts_are_timed_inside_a_pass_over_the_models_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shape_a = [torch.randn(4, 8), torch.randn(4, 8)]  # 128 bytes each
    other = torch.randn(6, 8)
    model = [shape_a[0], other, shape_a[1], torch.randn(5, 8)]
    run = cpu_linear._step_pass(shape_a, model)
    assert [(w is m, timed) for (w, timed), m in zip(run, model, strict=True)] == [
        (True, True), (True, False), (True, True), (True, False),
    ]  # fmt: skip
    monkeypatch.setattr(cpu_linear, "STEP_PASS_BYTES", 200)  # the model's first two weights
    lm_head = torch.randn(4, 8)  # a shape whose only weight comes last, as the output head
    run = cpu_linear._step_pass([lm_head], model)
    assert [w is m for (w, _), m in zip(run, [*model[:2], lm_head], strict=True)] == [True] * 3
    assert [timed for _, timed in run] == [False, False, True]
    measure = cpu_linear._measure(shape_a, None, model)
    assert measure("onednn", 2) > 0 and measure("torch", 64) > 0 and measure("torch", 1) > 0
