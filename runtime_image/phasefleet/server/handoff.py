"""The decode side of the KV hand-off: ask a prefill worker for the first token (and its logprobs
when the request wants them), pull the prompt's KV from it, release its lease. A request that
wants prompt logprobs (echo) is prefilled on the decode worker instead: see `wants_remote`.

Every failure here is survivable: no answer from the prefill worker means this worker prefills
the prompt itself; a failed, short or slow pull means it recomputes the prompt from the first
token on. `HandoffFailed.reason` says which, for the failures counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from phasefleet.api.contract import INTERNAL_TOKEN_HEADER
from phasefleet.engine.kv_transfer import KVLayout
from phasefleet.engine.outputs import TokenLogprob
from phasefleet.server.kv_pull import PullError, get_into

if TYPE_CHECKING:
    import torch

    from phasefleet.engine.sampling_params import SamplingParams

PREFILL_PATH = "/internal/prefill"
KV_PATH = "/internal/kv/{request_id}"


class HandoffFailed(Exception):
    """A hand-off step failed; `reason` is a metric label: prefill_unreachable, prefill_refused,
    layout_mismatch, lease_expired, pull_failed, pull_short, pull_timeout."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class PrefillResult:
    """What a prefill worker answered for one request."""

    first_token_id: int
    finish_reason: str  # 'handoff' (KV leased: pull it) or a final reason (stop, length)
    num_prompt_tokens: int
    kv_request_id: str | None  # the lease's id on the prefill worker; None unless 'handoff'
    layout: KVLayout | None
    num_cached_tokens: int  # prompt tokens the prefill worker found in its prefix cache
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs


def wants_remote(params: SamplingParams) -> bool:
    """Whether a prefill worker can do this request's prefill: not when it wants the prompt's
    logprobs, which only the worker that computes every prompt position has."""
    return params.prompt_logprobs is None


def prefill_body(request_id: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "prompt_token_ids": prompt,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "min_tokens": params.min_tokens,
        "logprobs": params.logprobs,
    }


def parse_prefill(data: Any) -> PrefillResult:
    """ValueError when the answer is malformed."""
    if not isinstance(data, dict):
        raise ValueError("the prefill answer is not an object")
    kv = data.get("kv")
    first = data.get("first_logprob")
    return PrefillResult(
        first_token_id=int(data["first_token_id"]),
        finish_reason=str(data["finish_reason"]),
        num_prompt_tokens=int(data["num_prompt_tokens"]),
        kv_request_id=None if kv is None else str(kv["request_id"]),
        layout=None if kv is None else KVLayout.from_wire(kv["layout"]),
        num_cached_tokens=int(data.get("num_cached_tokens", 0)),
        first_logprob=None
        if first is None
        else TokenLogprob(
            token_id=int(data["first_token_id"]),
            logprob=float(first["logprob"]),
            top=[(int(t), float(v)) for t, v in first["top"]],
        ),
    )


@dataclass
class HandoffClient:
    """One decode worker's connection to the prefill workers (shared keep-alive client)."""

    client: httpx.AsyncClient
    token: str  # the service's internal token
    prefill_timeout: float = 120.0  # seconds for a prefill answer (it may queue behind others)
    pull_timeout: float = 30.0  # seconds for a whole pull, after which the prompt is recomputed

    def _headers(self) -> dict[str, str]:
        return {INTERNAL_TOKEN_HEADER: self.token}

    async def prefill(
        self, prefill_url: str, request_id: str, prompt: list[int], params: SamplingParams
    ) -> PrefillResult:
        try:
            response = await self.client.post(
                prefill_url.rstrip("/") + PREFILL_PATH,
                json=prefill_body(request_id, prompt, params),
                headers=self._headers(),
                timeout=self.prefill_timeout,
            )
        except httpx.HTTPError as exc:
            raise HandoffFailed("prefill_unreachable", repr(exc)) from None
        if response.status_code != 200:
            raise HandoffFailed("prefill_refused", f"{response.status_code} {response.text[:200]}")
        try:
            return parse_prefill(response.json())
        except (ValueError, KeyError, TypeError) as exc:
            raise HandoffFailed("prefill_refused", f"malformed answer: {exc}") from None

    async def pull(
        self, prefill_url: str, result: PrefillResult, layout: KVLayout, block_size: int
    ) -> tuple[torch.Tensor, float]:
        """The prompt's KV in wire layout (uint8) and the seconds the pull took."""
        import torch

        if result.layout is None or result.kv_request_id is None:
            raise HandoffFailed("pull_failed", "the prefill worker leased no KV")
        why = layout.mismatch(result.layout)
        if why is not None:
            raise HandoffFailed("layout_mismatch", why)
        num_blocks = -(-result.num_prompt_tokens // block_size)
        expected = layout.payload_bytes(num_blocks)
        buffer = bytearray(expected)
        url = prefill_url.rstrip("/") + KV_PATH.format(request_id=result.kv_request_id)
        started = time.monotonic()
        try:  # the socket fills `buffer` in a thread; the event loop goes on meanwhile
            received = await asyncio.to_thread(
                get_into, url, self._headers(), memoryview(buffer), self.pull_timeout
            )
        except PullError as exc:
            raise HandoffFailed(exc.reason, str(exc)) from None
        if received != expected:
            raise HandoffFailed("pull_short", f"{received} of {expected} bytes")
        return torch.frombuffer(buffer, dtype=torch.uint8), time.monotonic() - started

    async def release(self, prefill_url: str, kv_request_id: str) -> None:
        """Frees the lease on the prefill worker; best effort (an unreleased lease expires)."""
        url = prefill_url.rstrip("/") + KV_PATH.format(request_id=kv_request_id)
        with contextlib.suppress(httpx.HTTPError):
            await self.client.delete(url, headers=self._headers(), timeout=5.0)


@dataclass
class RemotePrefill:
    """How one request on a decode worker gets its prompt prefilled elsewhere."""

    client: HandoffClient
    prefill_url: str  # the prefill worker the router picked
    # (first token, stop strings) -> (its text, whether a stop string ended it); tokenizer thread
    first_token_text: Callable[[int, list[str]], Awaitable[tuple[str, bool]]]
