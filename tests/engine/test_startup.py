"""The engine times each phase of its loading, in the order they ran."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from phasefleet.engine.config import EngineConfig
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.startup import StartupTimes


def test_phases_add_up_in_order_and_describe_themselves() -> None:
    times = StartupTimes()
    times.add("imports", 1.5)
    with times.phase("weights"):
        pass
    times.add("imports", 0.25)  # a phase met twice adds up, keeping its first place
    seconds = times.seconds()
    assert list(seconds) == ["imports", "weights"]
    assert seconds["imports"] == 1.75 and 0 <= seconds["weights"] < 1
    assert times.describe().startswith("imports 1.75 s, weights 0.00 s (total 1.75 s)"[:22])
    assert times.describe().endswith("(total 1.75 s)")


def test_the_engine_records_its_loading_phases(tiny_model: Callable[[str], Path]) -> None:
    times = StartupTimes()
    times.add("imports", 2.0)
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model("llama")), device="cpu", num_kv_blocks=16),
        startup=times,
    )
    assert engine.startup is times
    phases = list(times.seconds())
    assert phases[:3] == ["imports", "config", "weights"]
    assert phases[-1] == "kv_cache"
    assert set(phases) <= {"imports", "config", "weights", "cpu_linear_plan", "kv_cache"}
    assert all(s >= 0 for s in times.seconds().values())
