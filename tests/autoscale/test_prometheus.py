"""PrometheusSource's PromQL, and how it turns Prometheus' answers (from a localhost server that
answers the query API as Prometheus does) and its failures into Signals or MetricsUnavailable.
The same source against a real Prometheus is e2e/test_autoscale_sources.py."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from phasefleet.autoscale.prometheus import PrometheusSource
from phasefleet.autoscale.signals import MetricsUnavailable

SELECTOR = 'namespace="ns",inferenceservice="llm",role=~"prefill|decode"'


class FakePrometheus:
    """Answers /api/v1/query with `answers[query]` (an empty vector for other queries)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[dict[str, Any]]] = {}
        self.status = 200
        self.body: bytes | None = None  # sent as is instead of the JSON answer
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["query"][0]
                result = fake.answers.get(query, [])
                data = {"status": "success", "data": {"resultType": "vector", "result": result}}
                body = fake.body if fake.body is not None else json.dumps(data).encode()
                self.send_response(fake.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def prom() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def sample(value: float | str, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1_700_000_000.0, str(value)]}


def source(url: str, service: str = "llm") -> PrometheusSource:
    return PrometheusSource(url, "ns", service, ["prefill", "decode"], percentile=0.9, window_s=60)


def test_queries_select_the_service_by_its_labels_and_pools_by_engine_role() -> None:
    q = source("http://prom:9090").queries()
    router = 'namespace="ns",inferenceservice="llm",role=~"router"'
    assert q["ttft"] == (
        "histogram_quantile(0.9, sum by (le) "
        f"(rate(phasefleet_time_to_first_token_seconds_bucket{{{router}}}[60s])))"
    )
    assert q["request_rate"] == (
        f"sum(rate(phasefleet_e2e_request_latency_seconds_count{{{router}}}[60s]))"
    )
    assert q["kv_usage_sum"] == f"sum by (role) (phasefleet_kv_cache_usage_perc{{{SELECTOR}}})"
    backlog = "phasefleet_prefill_tokens_pending|phasefleet_prefill_tokens_waiting"
    assert q["prefill_backlog"] == f'sum by (role) ({{__name__=~"{backlog}",{SELECTOR}}})'
    assert q["busy"] == (
        f"avg by (role) (rate(phasefleet_engine_busy_seconds_total{{{SELECTOR}}}[60s]))"
    )
    assert q["sampled_at"] == f"max(timestamp(phasefleet_num_requests_running{{{SELECTOR}}}))"
    assert q["held"] == f"sum by (worker_pool) (phasefleet_router_requests_held{{{router}}})"
    # the peak gauges cover 30 s each: over a 60 s window, their highest of the other 30 s too
    assert q["requests_peak"] == (
        f"sum by (role) (max_over_time(phasefleet_num_requests_peak{{{SELECTOR}}}[30s]))"
    )
    at_default = PrometheusSource("http://p", "ns", "llm", ["prefill", "decode"], window_s=30)
    assert at_default.queries()["kv_usage_peak_sum"] == (
        f"sum by (role) (phasefleet_kv_cache_usage_peak_perc{{{SELECTOR}}})"
    )
    odd = PrometheusSource("http://p", 'a"b', "c\\d", ["worker"]).selector("both")
    assert odd == 'namespace="a\\"b",inferenceservice="c\\\\d",role=~"both"'


def test_answers_become_per_pool_signals(prom: FakePrometheus) -> None:
    src = source(prom.url)
    q = src.queries()
    prom.answers = {
        q["ttft"]: [sample(0.42)],
        q["tpot"]: [sample("NaN")],  # no streams finished in the window
        q["request_rate"]: [sample(3.5)],
        q["kv_usage_sum"]: [sample(1.3, role="decode"), sample(0.1, role="prefill")],
        q["prefill_backlog"]: [sample(2048, role="prefill"), sample(0, role="decode")],
        q["prompt_rate"]: [sample(900, role="prefill")],
        q["generation_rate"]: [sample(120, role="decode")],
        q["busy"]: [sample(0.8, role="prefill"), sample(0.35, role="decode")],
        q["running"]: [sample(2, role="prefill"), sample(9, role="decode")],
        q["waiting"]: [sample(4, role="prefill"), sample(0, role="decode")],
        q["requests_peak"]: [sample(14, role="decode")],
        q["kv_usage_peak_sum"]: [sample(1.7, role="decode")],
        q["pod_running"]: [
            sample(2, role="prefill", pod="llm-prefill-a"),
            sample(5, role="decode", pod="llm-decode-a"),
            sample(4, role="decode", pod="llm-decode-b"),
        ],
        q["pod_kv"]: [
            sample(0.1, role="prefill", pod="llm-prefill-a"),
            sample(0.7, role="decode", pod="llm-decode-a"),
            sample(0.6, role="decode", pod="llm-decode-b"),
        ],
        q["sampled_at"]: [sample(1_699_999_998.5)],
    }
    signals = src.read(now=0.0)
    assert signals.sampled_at == 1_699_999_998.5 and signals.window_s == 60
    assert (signals.ttft_s, signals.tpot_s, signals.itl_s) == (0.42, None, None)
    assert signals.request_rate == 3.5
    pre, dec = signals.pools["prefill"], signals.pools["decode"]
    assert (pre.reporting, dec.reporting) == (1, 2)
    assert (pre.prefill_backlog_tokens, pre.prompt_tokens_per_s, pre.busy_fraction) == (
        2048,
        900,
        0.8,
    )
    assert pre.generation_tokens_per_s is None  # no series for it
    assert (dec.kv_usage_sum, dec.generation_tokens_per_s, dec.running, dec.waiting) == (
        1.3,
        120,
        9,
        0,
    )
    assert dec.pods["llm-decode-b"].running == 4 and dec.pods["llm-decode-b"].kv_usage == 0.6
    assert set(pre.pods) == {"llm-prefill-a"}
    assert (dec.requests_peak, dec.kv_usage_peak_sum) == (14, 1.7)
    assert pre.requests_peak is None  # a worker image without the peak gauges


def test_no_worker_series_is_no_samples(prom: FakePrometheus) -> None:
    with pytest.raises(MetricsUnavailable) as failed:
        source(prom.url).read(now=0.0)
    assert failed.value.reason == "NoSamples"
    assert "ns/llm" in failed.value.message and prom.url in failed.value.message


def test_scaled_to_zero_the_routers_held_requests_are_read(prom: FakePrometheus) -> None:
    src = source(prom.url)
    prom.answers = {src.queries()["held"]: [sample(2, worker_pool="decode")]}
    signals = src.read(now=5.0)
    assert signals.held == {"decode": 2.0} and signals.pools == {}
    assert signals.sampled_at == 5.0


@pytest.mark.parametrize("status, body", [(500, None), (400, None), (200, b"<html>not it</html>")])
def test_bad_answers_are_prometheus_errors(
    prom: FakePrometheus, status: int, body: bytes | None
) -> None:
    prom.status, prom.body = status, body
    with pytest.raises(MetricsUnavailable) as failed:
        source(prom.url).read(now=0.0)
    assert failed.value.reason == "PrometheusError"
    assert prom.url in failed.value.message and "prometheus.url" in failed.value.message


def test_nothing_listening_is_unreachable_without_a_long_backoff() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
        began = time.monotonic()
        with pytest.raises(MetricsUnavailable) as failed:
            source(url).read(now=0.0)
    assert failed.value.reason == "PrometheusUnreachable" and url in failed.value.message
    assert time.monotonic() - began < 3


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="url"):
        PrometheusSource("prom:9090", "ns", "llm", ["worker"])
    with pytest.raises(ValueError, match="percentile"):
        PrometheusSource("http://prom:9090", "ns", "llm", ["worker"], percentile=90)
    with pytest.raises(ValueError, match="window_s"):
        PrometheusSource("http://prom:9090", "ns", "llm", ["worker"], window_s=0.5)
    with pytest.raises(ValueError, match="pools"):
        PrometheusSource("http://prom:9090", "ns", "llm", ["router"])


def test_worker_series_of_pods_being_deleted_are_left_out(prom: FakePrometheus) -> None:
    leaving = {"llm-decode-b", "llm-decode-c"}
    src = PrometheusSource(prom.url, "ns", "llm", ["prefill", "decode"], leaving=lambda: leaving)
    q = src.queries(leaving)
    workers = SELECTOR + ',pod!~"llm\\\\-decode\\\\-b|llm\\\\-decode\\\\-c"'
    assert q["kv_usage_sum"] == f"sum by (role) (phasefleet_kv_cache_usage_perc{{{workers}}})"
    assert "pod!~" not in q["ttft"]  # a router pod's requests still count
    # only the queries with the pods left out are answered: read must send those
    prom.answers = {
        q["pod_running"]: [sample(5, role="decode", pod="llm-decode-a")],
        q["kv_usage_sum"]: [sample(0.6, role="decode")],
        q["sampled_at"]: [sample(1_699_999_998.5)],
    }
    decode = src.read(now=0.0).pools["decode"]
    assert (decode.reporting, decode.kv_usage_sum, set(decode.pods)) == (1, 0.6, {"llm-decode-a"})
