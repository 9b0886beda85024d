"""A peer load generator against our endpoints: guidellm (installed by `make tools` into a
virtualenv of its own, e2e/tools/install-guidellm.sh) drives a disaggregated fleet (a router, a
prefill and a decode worker: real HTTP and the KV hand-off) at a constant rate through the
OpenAI chat API. Every request must complete with the tokens asked for, and the router's own
counters must agree with what guidellm sent and measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from phasefleet.api.contract import INTERNAL_TOKEN_ENV
from tests.router.router_proc import Router, run_router
from tests.server.worker_proc import Worker, run_worker

INSTALL = Path(__file__).parent / "tools" / "install-guidellm.sh"
REQUESTS = 24
RATE = 3.0  # requests per second
PROMPT_TOKENS, OUTPUT = 96, 12  # synthetic prompts' tokens, and the tokens each answer asks for
WORKER_ARGS = ("--num-kv-blocks", "256", "--remote-prefill-min-tokens", "0")
ROUTER_COUNT = 'phasefleet_e2e_request_latency_seconds_count{model_name="tiny",role="router"}'


@dataclass
class Fleet:
    router: Router
    decode: Worker


def guidellm_binary() -> Path:
    printed = subprocess.run(
        ["bash", str(INSTALL), "--print"], check=True, capture_output=True, text=True
    )
    binary = Path(printed.stdout.strip())
    if not binary.exists():
        pytest.fail(f"guidellm is not installed at {binary}: run `make tools`")
    return binary


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    members = tmp_path_factory.mktemp("fleet") / "workers.json"
    mp = pytest.MonkeyPatch()
    mp.setenv(INTERNAL_TOKEN_ENV, "load-generator-test")
    try:
        with (
            run_worker(tiny_model, "--role", "prefill", *WORKER_ARGS) as prefill,
            run_worker(tiny_model, "--role", "decode", *WORKER_ARGS) as decode,
        ):
            members.write_text(
                json.dumps({"prefill": [prefill.base_url], "decode": [decode.base_url]})
            )
            args = ("--workers-file", str(members), "--refresh-interval", "0.5")
            with run_router(*args) as router:
                yield Fleet(router, decode)
    finally:
        mp.undo()


def run_guidellm(router: Router, model: Path, out: Path) -> dict[str, Any]:
    """One constant-rate benchmark of REQUESTS requests; guidellm's JSON report."""
    command = [
        str(guidellm_binary()), "run",
        "--backend", f"kind=openai_http,target={router.base_url},model=tiny",
        "--profile", f"kind=constant,rate={RATE}",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT}",
        "--tokenizer", f"kind=huggingface_auto,model={model}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def remote_prefills(worker: Worker) -> float:
    """The decode worker's prompts whose KV it pulled from a prefill worker."""
    samples = worker.metrics()
    return sum(
        v
        for k, v in samples.items()
        if k.startswith("phasefleet_prefills_total{") and 'where="remote"' in k
    )


def quiet_router_count(router: Router) -> float:
    """The router's count of answered requests once it stops changing (nothing in flight)."""
    last = router.metrics().get(ROUTER_COUNT, 0.0)
    while True:
        time.sleep(1.0)
        now = router.metrics().get(ROUTER_COUNT, 0.0)
        if now == last:
            return now
        last = now


def test_guidellm_at_a_constant_rate_gets_every_answer_in_full(
    fleet: Fleet, tiny_model: Path, tmp_path: Path
) -> None:
    for attempt in range(2):
        before, pulled = quiet_router_count(fleet.router), remote_prefills(fleet.decode)
        report = run_guidellm(fleet.router, tiny_model, tmp_path / f"guidellm-{attempt}.json")
        benchmark = report["benchmarks"][0]
        state = benchmark["scheduler_state"]
        # guidellm 0.8.1 on a starved CPU sometimes ends its run with a request still in flight
        # that it then counts nowhere (created 24, processed 23, processing 1, errored 0): its
        # own accounting, not an answer of ours. Only that case runs it once more.
        if state["processing_requests"] == 0:
            break
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    assert (state["created_requests"], state["cancelled_requests"]) == (REQUESTS, 0)
    requests = benchmark["requests"]["successful"]
    assert [r["output_tokens"] for r in requests] == [OUTPUT] * REQUESTS
    assert all(r["time_to_first_token_ms"] > 0 for r in requests)

    after = fleet.router.metrics()
    assert after[ROUTER_COUNT] - before == REQUESTS  # none lost, none extra
    # every prompt was prefilled on the prefill worker, its KV pulled by the decode worker
    assert remote_prefills(fleet.decode) - pulled == REQUESTS
