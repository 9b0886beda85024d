"""LoRA adapters across a fleet, over real processes and HTTP: the router sends an adapter's
requests only to the workers that have it loaded, lists every worker's adapters, loads and
unloads runtime adapters on every worker, and loads them onto a worker that joins."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from phasefleet.engine.tiny_lora import make_tiny_lora
from tests.router.router_proc import run_router
from tests.server.worker_proc import Served, Worker, run_worker

PROMPT = [17, 250, 31, 402, 88, 9, 140, 77, 301, 12]
RUNTIME = ("--enable-runtime-lora", "--max-loras", "2", "--num-kv-blocks", "64")
REFRESH_S = 0.5  # the router's --refresh-interval
GENERATED = "phasefleet_generation_tokens_total"


def post(served: Served, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{served.base_url}/v1/{path}", json=body, timeout=60)


def model_ids(served: Served) -> list[str]:
    return [m.id for m in served.client().models.list()]


def generated(worker: Worker) -> float:
    return sum(v for k, v in worker.metrics().items() if k.startswith(GENERATED))


def answer(served: Served, model: str) -> str:
    out = served.client().completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0
    )
    return out.choices[0].text


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "sql": make_tiny_lora(root / "sql", tiny_model, rank=4, seed=1),
        "poet": make_tiny_lora(root / "poet", tiny_model, rank=4, seed=2),
    }


def test_runtime_adapters_across_a_fleet(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    members = tmp_path / "workers.json"
    sql, poet = str(adapters["sql"]), str(adapters["poet"])
    with run_worker(tiny_model, *RUNTIME) as a, run_worker(tiny_model, *RUNTIME) as b:
        members.write_text(json.dumps({"worker": [a.base_url, b.base_url]}))
        router_args = ("--workers-file", str(members), "--refresh-interval", str(REFRESH_S))
        with run_router(*router_args, "--policy", "round-robin") as router:
            # An adapter on one worker only (loaded there directly): round-robin would send
            # every other request to the other worker, which would answer 404.
            assert post(a, "load_lora_adapter", {"lora_name": "poet", "lora_path": poet})
            time.sleep(3 * REFRESH_S)  # the router's next poll of a's /metrics
            before = generated(b)
            answers = {answer(router, "poet") for _ in range(6)}
            assert answers == {answer(a, "poet")}
            assert generated(b) == before
            assert {answer(router, "tiny") for _ in range(2)} == {answer(b, "tiny")}
            assert generated(b) > before  # the base model still goes to both
            assert "poet" in model_ids(router) and "poet" not in model_ids(b)

            # Through the router: on every worker; the same answer from each.
            loaded = post(router, "load_lora_adapter", {"lora_name": "sql", "lora_path": sql})
            assert loaded.status_code == 200, loaded.text
            assert "added on 2 of 2 workers" in loaded.text
            assert "sql" in model_ids(a) and "sql" in model_ids(b)
            assert answer(a, "sql") == answer(b, "sql") != answer(a, "tiny")

            with run_worker(tiny_model, *RUNTIME) as c:
                # A worker that joins gets what the router loaded, not what it did not.
                members.write_text(json.dumps({"worker": [a.base_url, b.base_url, c.base_url]}))
                wait_for(lambda: "sql" in model_ids(c), "the router to load sql onto c")
                assert "poet" not in model_ids(c)
                assert answer(c, "sql") == answer(a, "sql")

                unloaded = post(router, "unload_lora_adapter", {"lora_name": "sql"})
                assert unloaded.status_code == 200, unloaded.text
                assert "removed from 3 workers" in unloaded.text
                assert all("sql" not in model_ids(w) for w in (a, b, c))
                with pytest.raises(openai.NotFoundError, match="sql"):
                    answer(router, "sql")

            # Every worker refuses a folder that is no adapter: their 400, nothing loaded.
            bad = post(router, "load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
            assert bad.status_code == 400
            assert "has no adapter_config.json" in bad.json()["error"]["message"]
            assert post(router, "load_lora_adapter", {"lora_name": 3}).status_code == 400
            assert "x" not in model_ids(router)


def test_without_runtime_lora_the_router_passes_the_workers_404(tiny_model: Path) -> None:
    with (
        run_worker(tiny_model, "--num-kv-blocks", "64") as worker,
        run_router("--workers", worker.base_url) as router,
    ):
        refused = post(router, "load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"})
        assert refused.status_code == 404
        assert model_ids(router) == ["tiny"]
