"""Where a decode worker prefills a prompt (WorkerState.remote_prefill), from the router's
headers and its own load: the TPOT target comes with the request, so a change of the
service's target needs no restart of the decode pool."""

from __future__ import annotations

from typing import cast

import pytest

from phasefleet.api.boundary import PhaseBoundary
from phasefleet.api.contract import (
    INTERNAL_TOKEN_HEADER,
    PREFILL_BACKLOG_HEADER,
    PREFILL_SPEED_HEADER,
    PREFILL_URL_HEADER,
    TPOT_TARGET_HEADER,
)
from phasefleet.engine.outputs import EngineStats
from phasefleet.server.async_engine import AsyncEngine
from phasefleet.server.handoff import HandoffClient
from phasefleet.server.metrics import WorkerMetrics
from phasefleet.server.state import WorkerState

TOKEN = "test-internal-token"
PROMPT = list(range(300))  # over the 200-token threshold: remote unless this worker has room


class BusyEngine:
    """The two reads the boundary makes of the engine: four requests decoding, no prompt
    waiting, nothing of the prompt cached."""

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=4, num_waiting=0, kv_cache_usage=0.2, num_free_blocks=80,
            num_total_blocks=100, prefill_tokens_pending=0, num_preemptions_total=0,
            prefix_cache_queries_total=0, prefix_cache_hits_total=0, prompt_tokens_total=0,
            generation_tokens_total=0,
        )  # fmt: skip

    def cached_prefix_tokens(self, prompt: list[int], lora: str | None = None) -> int:
        return 0


def decode_state(tpot_target_ms: int | None) -> WorkerState:
    """A decode worker with the adaptive boundary, 30 ms between tokens and 10-token answers:
    the 300-token prompt at 2000 tokens/s adds 150 / 10 = 15 ms a token, 45 ms in all, within
    0.8 of a 100 ms target and over 0.8 of a 50 ms one."""
    engine = BusyEngine()
    metrics = WorkerMetrics("tiny", "decode", engine.stats)
    metrics.observe_itl(0.030)
    metrics.observe_answer(10)
    return WorkerState(
        engine=cast(AsyncEngine, engine),
        tokenizer=None,
        vocab_size=512,
        served_model_name="tiny",
        role="decode",
        metrics=metrics,
        internal_token=TOKEN,
        handoff=HandoffClient(TOKEN),
        boundary=PhaseBoundary(min_tokens=200, adaptive=True),
        tpot_target_s=None if tpot_target_ms is None else tpot_target_ms / 1000,
    )


def router_headers(tpot_target_ms: int | None, token: str = TOKEN) -> dict[str, str]:
    """The prefill worker is backlogged (5 s), so the boundary asks whether this one has room."""
    headers = {
        PREFILL_URL_HEADER: "http://prefill:8000",
        INTERNAL_TOKEN_HEADER: token,
        PREFILL_BACKLOG_HEADER: "5000",
        PREFILL_SPEED_HEADER: "2000",
    }
    if tpot_target_ms is not None:
        headers[TPOT_TARGET_HEADER] = str(tpot_target_ms)
    return headers


@pytest.mark.parametrize(
    ("flag_ms", "header_ms", "local"),
    [
        (50, 100, True),  # the router's target wins over the worker's flag
        (100, 50, False),
        (100, None, True),  # no header: the worker's own flag
        (50, None, False),
        (None, None, True),  # no target at all: the token bound alone
        (None, 50, False),
        (None, 0, True),  # not a positive number: as if absent
    ],
)
def test_the_tpot_target_the_router_sends_bounds_local_prefill(
    flag_ms: int | None, header_ms: int | None, local: bool
) -> None:
    remote = decode_state(flag_ms).remote_prefill(router_headers(header_ms), [PROMPT])
    assert (remote is None) is local
    if remote is not None:
        assert remote.prefill_url == "http://prefill:8000"


def test_a_tpot_target_without_the_internal_token_is_not_read() -> None:
    """Only the router (with the service's token) names a prefill worker and a target: with a
    wrong token the prompt is prefilled here whatever the headers say."""
    state = decode_state(None)
    assert state.remote_prefill(router_headers(50, token="wrong"), [PROMPT]) is None
