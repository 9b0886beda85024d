"""What the router reads from a worker's bytes: SSE framing, event kinds, load from /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from phasefleet.router.discovery import DnsDiscovery, StaticDiscovery, parse_host_port
from phasefleet.router.policy import WorkerLoad
from phasefleet.router.upstream import (
    Event,
    classify,
    error_message,
    event_data,
    load_of,
    parse_metrics,
    sse_events,
)


def response_of(*parts: bytes) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    return httpx.Response(200, content=body())


async def collect(response: httpx.Response) -> list[bytes]:
    return [event async for event in sse_events(response)]


def test_events_are_cut_at_blank_lines_however_the_bytes_arrive() -> None:
    events = [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]
    whole = b"".join(events)
    for split in (1, 5, len(events[0]), len(whole) - 1):
        got = asyncio.run(collect(response_of(whole[:split], whole[split:])))
        assert got == events
    one_byte_at_a_time = [whole[i : i + 1] for i in range(len(whole))]
    assert asyncio.run(collect(response_of(*one_byte_at_a_time))) == events


def test_a_stream_cut_inside_an_event_is_an_error() -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(collect(response_of(b'data: {"a":1}\n\ndata: {"b"')))


def chunk(**fields: object) -> bytes:
    return f"data: {json.dumps(fields, separators=(',', ':'))}\n\n".encode()


def test_classify_tells_tokens_from_the_rest() -> None:
    role = chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    token = chunk(choices=[{"index": 0, "delta": {"content": 'say "role":"assistant"'}}])
    finish = chunk(choices=[{"index": 0, "text": "", "finish_reason": "length"}])
    usage = chunk(choices=[], usage={"prompt_tokens": 3})
    error = chunk(error={"message": "boom"})
    assert classify(role) is Event.OTHER
    assert classify(token) is Event.TOKEN  # quotes inside generated text are escaped
    assert classify(finish) is Event.TOKEN
    assert classify(usage) is Event.OTHER
    assert classify(error) is Event.ERROR
    assert classify(b"data: [DONE]\n\n") is Event.DONE
    assert classify(b": keep-alive\n\n") is Event.OTHER


def test_classify_reads_the_responses_apis_named_events() -> None:
    def event(kind: str, **fields: object) -> bytes:
        data = json.dumps({"type": kind, **fields}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    assert classify(event("response.created", response={})) is Event.OTHER
    assert classify(event("response.output_text.delta", delta="event: error")) is Event.TOKEN
    calls = event("response.function_call_arguments.delta", delta="{}")  # an answer of calls
    thought = event("response.reasoning_text.delta", delta="hm")  # the thought comes first
    assert classify(calls) is Event.TOKEN and classify(thought) is Event.TOKEN
    for end in ("completed", "incomplete", "failed"):
        assert classify(event(f"response.{end}", response={})) is Event.DONE
    assert classify(event("error", message="boom")) is Event.ERROR
    assert classify(event("response.output_text.done", text="x")) is Event.OTHER


def test_an_in_band_errors_message_is_read_from_either_api() -> None:
    chat = chunk(error={"message": "boom", "code": "request_failed"})
    named = b'event: error\ndata: {"type":"error","message":"boom","code":"request_failed"}\n\n'
    assert event_data(named) == b'{"type":"error","message":"boom","code":"request_failed"}'
    assert error_message(event_data(chat)) == error_message(event_data(named)) == "boom"
    assert error_message(b"<html>bad gateway") == "<html>bad gateway"


def load_of_text(text: str) -> WorkerLoad:
    return load_of(parse_metrics(text)[0])


def test_the_load_is_read_from_the_gauges_and_the_throughput_counters() -> None:
    text = "\n".join(
        [
            "# HELP phasefleet_num_requests_running Requests in the running batch.",
            'phasefleet_num_requests_running{model_name="m",role="both"} 3.0',
            'phasefleet_num_requests_waiting{model_name="m",role="both"} 1.0',
            'phasefleet_kv_cache_usage_perc{model_name="m",role="both"} 0.25',
            'phasefleet_prompt_tokens_total{model_name="m",role="both"} 99.0',
        ]
    )
    assert load_of_text(text) == WorkerLoad(
        running=3, waiting=1, kv_usage=0.25, prompt_tokens_total=99
    )
    backlog = 'phasefleet_prefill_tokens_pending{role="prefill"} 700.0'
    queued = 'phasefleet_prefill_tokens_waiting{role="prefill"} 4096.0'
    busy = 'phasefleet_engine_busy_seconds_total{role="prefill"} 1.5'
    assert load_of_text("\n".join([text, backlog, queued, busy])) == WorkerLoad(
        running=3, waiting=1, kv_usage=0.25, prefill_pending=700, prefill_waiting=4096,
        prompt_tokens_total=99, busy_seconds_total=1.5,
    )  # fmt: skip
    with pytest.raises(ValueError, match="phasefleet_kv_cache_usage_perc"):
        load_of_text(text.replace("kv_cache_usage_perc", "something_else"))


def test_static_and_dns_discovery() -> None:
    static = StaticDiscovery(["h:1", "http://h:1/", "https://g:2"])
    assert [e.url for e in asyncio.run(static.endpoints())] == ["http://h:1", "https://g:2"]
    with pytest.raises(ValueError, match="empty"):
        StaticDiscovery([])
    dns = DnsDiscovery("localhost:8123")
    urls = {e.url for e in asyncio.run(dns.endpoints())}
    assert "http://127.0.0.1:8123" in urls
    assert all(e.ready for e in asyncio.run(dns.endpoints()))
    assert parse_host_port("svc.ns.svc:8000") == ("svc.ns.svc", 8000)
    for bad in ("svc", "svc:", ":80", "svc:http", "svc:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_host_port(bad)
