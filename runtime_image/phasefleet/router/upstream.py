"""Talking to workers: one shared keep-alive httpx client, SSE framing, load polls.

Streams pass through as the worker's own bytes. The router only cuts them at event boundaries
(so an error event never lands inside a half-sent one) and looks at a few bytes of each event
to tell tokens from the rest, which is what the latency metrics need. That relies on the
worker's compact JSON (pydantic's `model_dump_json`): inside a JSON string a quote is escaped,
so the markers below cannot come from generated text.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import httpx

from phasefleet.api.contract import Metric
from phasefleet.router.policy import WorkerLoad

CONNECT_TIMEOUT = 2.0  # seconds to open a connection to a worker
READ_TIMEOUT = 600.0  # seconds without a byte from a worker before the request fails
POLL_TIMEOUT = 1.0  # seconds for one /health or /metrics poll
MAX_KEEPALIVE = 256  # idle connections kept open across all workers

_DONE = b"data: [DONE]"
# The Responses API names each event in an `event:` line and ends without [DONE].
# Output: the thought, text, or a function call's arguments (an answer of calls alone has no
# text), as a chat stream's reasoning_content, content and tool_calls deltas are.
_RESPONSE_TOKENS = (
    b"event: response.reasoning_text.delta\n",
    b"event: response.output_text.delta\n",
    b"event: response.function_call_arguments.delta\n",
)
_RESPONSE_ENDS = tuple(
    f"event: response.{end}\n".encode() for end in ("completed", "incomplete", "failed")
)
_RESPONSE_ERROR = b"event: error\n"
_ERROR = b'data: {"error"'
_NO_CHOICES = b'"choices":[]'  # the usage chunk
_ROLE = b'"role":"assistant"'  # a chat stream's opening chunk, before any token

# The worker's gauges that make up its load.
RUNNING = Metric.NUM_REQUESTS_RUNNING
WAITING = Metric.NUM_REQUESTS_WAITING
KV_USAGE = Metric.KV_CACHE_USAGE_PERC
PREFILL_PENDING = Metric.PREFILL_TOKENS_PENDING
PREFILL_WAITING = Metric.PREFILL_TOKENS_WAITING
PROMPT_TOKENS = Metric.PROMPT_TOKENS_TOTAL  # counters: a prefill worker's throughput
BUSY_SECONDS = Metric.ENGINE_BUSY_SECONDS_TOTAL
LOAD_SERIES = (RUNNING, WAITING, KV_USAGE, PREFILL_PENDING, PREFILL_WAITING, PROMPT_TOKENS,
               BUSY_SECONDS)  # fmt: skip
# Adapter names are [A-Za-z0-9][\w.:-]* (server/adapters.py): nothing to unescape.
_ADAPTER = re.compile(rf'^{Metric.LORA_ADAPTER_LOADED}{{.*\blora_name="([^"]*)"')


class Event(enum.Enum):
    TOKEN = "token"  # carries output (a choice's delta or finish)
    OTHER = "other"  # a chat role chunk, the usage chunk, a comment
    ERROR = "error"  # an in-band error: the worker failed the request after its 200
    DONE = "done"  # data: [DONE]


def classify(event: bytes) -> Event:
    if event.startswith(b"event:"):  # the Responses API's
        if event.startswith(_RESPONSE_TOKENS):
            return Event.TOKEN
        if event.startswith(_RESPONSE_ENDS):
            return Event.DONE
        return Event.ERROR if event.startswith(_RESPONSE_ERROR) else Event.OTHER
    if event.startswith(_DONE):
        return Event.DONE
    if event.startswith(_ERROR):
        return Event.ERROR
    if not event.startswith(b"data:") or _NO_CHOICES in event or _ROLE in event:
        return Event.OTHER
    return Event.TOKEN


async def sse_events(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """Complete events (each with its blank-line terminator) as they arrive. A stream that ends
    inside an event raises httpx.RemoteProtocolError."""
    buffer = b""
    async for data in response.aiter_raw():
        buffer += data
        end = buffer.rfind(b"\n\n")
        if end < 0:
            continue
        complete, buffer = buffer[: end + 2], buffer[end + 2 :]
        start = 0
        while start < len(complete):
            stop = complete.index(b"\n\n", start) + 2
            yield complete[start:stop]
            start = stop
    if buffer.strip():
        raise httpx.RemoteProtocolError("the worker's stream ended inside an event")


def event_data(event: bytes) -> bytes:
    """An event's `data:` payload (after an `event:` line, as the Responses API names them)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[len(b"data:") :].strip()
    return event.strip()


def error_message(content: bytes) -> str:
    """The message of an OpenAI-shaped error body (`{"error": {"message"}}`, or the Responses
    API's error event, `{"type": "error", "message"}`), else the body's start."""
    try:
        body = json.loads(content)
        return str(body["error"]["message"] if "error" in body else body["message"])
    except (ValueError, KeyError, TypeError):
        return content[:200].decode(errors="replace")


def parse_metrics(text: str) -> tuple[dict[str, float], frozenset[str]]:
    """A worker's /metrics text, read once: the load series' values, and the LoRA adapters it
    says are loaded (none without that series)."""
    values: dict[str, float] = {}
    adapters: set[str] = set()
    for line in text.splitlines():
        if line.startswith("phasefleet_"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in LOAD_SERIES:
                values[name] = float(line.rsplit(" ", 1)[1])
            elif (adapter := _ADAPTER.match(line)) is not None:
                adapters.add(adapter[1])
    return values, frozenset(adapters)


def load_of(values: dict[str, float]) -> WorkerLoad:
    """The load series' values -> the worker's load; ValueError if a gauge is missing."""
    missing = {RUNNING, WAITING, KV_USAGE} - values.keys()
    if missing:
        raise ValueError(f"the worker's /metrics lacks {', '.join(sorted(missing))}")
    return WorkerLoad(
        running=values[RUNNING],
        waiting=values[WAITING],
        kv_usage=values[KV_USAGE],
        prefill_pending=values.get(PREFILL_PENDING, 0.0),
        prefill_waiting=values.get(PREFILL_WAITING),
        prompt_tokens_total=values.get(PROMPT_TOKENS),
        busy_seconds_total=values.get(BUSY_SECONDS),
    )


@dataclass(frozen=True)
class Poll:
    """One poll of a worker."""

    healthy: bool  # /health answered 200
    load: WorkerLoad | None = None  # from /metrics; None if it did not answer or lacked a gauge
    adapters: frozenset[str] = frozenset()  # LoRA adapters loaded, from /metrics


class Upstream:
    """The router's one HTTP client to every worker (connection pooling, keep-alive)."""

    def __init__(self, read_timeout: float = READ_TIMEOUT) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=CONNECT_TIMEOUT, read=read_timeout, write=30, pool=30),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=MAX_KEEPALIVE),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """Sends the request; returns once the status and headers are in (body unread)."""
        request = self.client.build_request("POST", url, content=body, headers=headers)
        return await self.client.send(request, stream=True)

    async def get(self, url: str, timeout: float = POLL_TIMEOUT) -> httpx.Response:
        return await self.client.get(url, timeout=timeout)

    async def poll(self, base_url: str) -> Poll:
        """One worker's health, load and adapters; unhealthy when it cannot be reached. /health
        and /metrics are asked at once, so a hung worker costs one timeout, not two."""
        health, metrics = await asyncio.gather(
            self.get(f"{base_url}/health"), self.get(f"{base_url}/metrics"), return_exceptions=True
        )
        if not isinstance(health, httpx.Response) or health.status_code != 200:
            return Poll(healthy=False)
        if not isinstance(metrics, httpx.Response) or metrics.status_code != 200:
            return Poll(healthy=True)
        values, adapters = parse_metrics(metrics.text)
        try:
            return Poll(True, load_of(values), adapters)
        except ValueError:
            return Poll(True, None, adapters)
