"""What the router adds to a generation request it forwards (dispatch.forward_headers): the
service's targets travel per request, so changing one restarts no worker."""

from __future__ import annotations

from typing import Any

import pytest

from phasefleet.api.contract import (
    INTERNAL_TOKEN_HEADER,
    LATE_AFTER_HEADER,
    PREFILL_BACKLOG_HEADER,
    PREFILL_SPEED_HEADER,
    PREFILL_URL_HEADER,
    TPOT_TARGET_HEADER,
)
from phasefleet.router.config import RouterConfig
from phasefleet.router.dispatch import forward_headers
from phasefleet.router.policy import Candidate, WorkerLoad

PREFILL = "http://10.0.0.7:8000"


def config(**fields: Any) -> RouterConfig:
    return RouterConfig(served_model_name="tiny", policy="least-loaded", **fields)


def test_a_prefill_worker_is_named_with_the_token_and_the_tpot_target() -> None:
    measured = Candidate(PREFILL, WorkerLoad(1, 0, 0.1, prefill_pending=3000), 0, prefill_rate=2000)
    headers = forward_headers(
        config(internal_token="t", late_after_ms=800, tpot_target_ms=50), measured
    )
    assert headers == {
        "content-type": "application/json",
        LATE_AFTER_HEADER: "800",
        PREFILL_URL_HEADER: PREFILL,
        INTERNAL_TOKEN_HEADER: "t",
        TPOT_TARGET_HEADER: "50",
        PREFILL_BACKLOG_HEADER: "1500",  # 3000 prompt tokens at 2000 a second
        PREFILL_SPEED_HEADER: "2000",
    }


def test_without_a_prefill_worker_or_the_token_only_the_ttft_target_goes() -> None:
    """The TPOT target bounds a decode worker's local prefills of a prompt the router asked to
    be prefilled elsewhere: with no prefill worker named it has nothing to bound."""
    unmeasured = Candidate(PREFILL, None, 0)
    with_target = config(late_after_ms=800, tpot_target_ms=50)
    for cfg, prefill in [(with_target, unmeasured), (config(internal_token="t"), None)]:
        headers = forward_headers(cfg, prefill)
        assert TPOT_TARGET_HEADER not in headers and PREFILL_URL_HEADER not in headers
    assert forward_headers(with_target, None)[LATE_AFTER_HEADER] == "800"
    named = forward_headers(config(internal_token="t"), unmeasured)
    assert named[PREFILL_URL_HEADER] == PREFILL and TPOT_TARGET_HEADER not in named
    assert PREFILL_BACKLOG_HEADER not in named  # not measured yet: the threshold decides


def test_a_tpot_target_under_one_ms_is_refused() -> None:
    with pytest.raises(ValueError, match="tpot_target_ms must be >= 1 ms, got 0"):
        config(tpot_target_ms=0).validate()
