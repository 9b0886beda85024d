"""ScrapeSource against localhost servers that render the worker's and router's real metrics:
gauges summed per pool, rates and quantiles from the difference of two scrapes, and what
happens when targets do not answer."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

import pytest

from phasefleet.autoscale.scrape import (
    ScrapeSource,
    ScrapeTargets,
    bucket_increase,
    parse_exposition,
)
from phasefleet.autoscale.signals import MetricsUnavailable
from phasefleet.router.metrics import RouterMetrics
from tests.autoscale.exposition_server import FakeWorker, MetricsServer, serving

TTFT = "phasefleet_time_to_first_token_seconds"


def fixed(
    routers: list[MetricsServer], workers: Mapping[str, Mapping[str, MetricsServer]]
) -> Callable[[], ScrapeTargets]:
    targets = ScrapeTargets(
        routers=tuple(r.url for r in routers),
        workers={role: {n: s.url for n, s in pool.items()} for role, pool in workers.items()},
    )
    return lambda: targets


Fleet = tuple[RouterMetrics, FakeWorker, FakeWorker, list[MetricsServer]]


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    router, prefill, decode = RouterMetrics("tiny"), FakeWorker("prefill"), FakeWorker("decode")
    with serving(router, prefill, decode) as servers:
        yield router, prefill, decode, servers


def test_parse_sums_labels_and_keeps_buckets_by_bound() -> None:
    worker = FakeWorker()
    worker.stats = replace(worker.stats, num_running=3, prompt_tokens_total=40)
    worker.metrics.time_to_first_token.observe(0.03)
    worker.metrics.kv_transfer_failures["pull_failed"].inc(2)
    worker.metrics.kv_transfer_failures["pull_timeout"].inc(1)
    samples = parse_exposition(worker.render().decode())
    assert samples[("phasefleet_num_requests_running", "")] == 3
    assert samples[("phasefleet_prompt_tokens_total", "")] == 40
    assert samples[("phasefleet_kv_transfer_failures_total", "")] == 3  # summed over `reason`
    assert samples[(f"{TTFT}_bucket", "0.02")] == 0
    assert samples[(f"{TTFT}_bucket", "0.04")] == 1
    assert samples[(f"{TTFT}_bucket", "+Inf")] == 1
    assert samples[(f"{TTFT}_count", "")] == 1
    with pytest.raises(ValueError):
        parse_exposition("phasefleet_x{le=} not-a-number\n")


def test_bucket_increase_after_a_restart_is_the_new_histogram() -> None:
    old = {
        (f"{TTFT}_bucket", "0.1"): 5.0,
        (f"{TTFT}_bucket", "+Inf"): 9.0,
        (f"{TTFT}_count", ""): 9.0,
    }
    new = {
        (f"{TTFT}_bucket", "0.1"): 1.0,
        (f"{TTFT}_bucket", "+Inf"): 2.0,
        (f"{TTFT}_count", ""): 2.0,
    }
    assert bucket_increase(new, old, TTFT) == {0.1: 1.0, math.inf: 2.0}
    grown = {k: v + 10 for k, v in old.items()}
    assert bucket_increase(grown, old, TTFT) == {0.1: 10.0, math.inf: 10.0}


def test_first_read_has_gauges_and_no_rates(fleet: Fleet) -> None:
    router, prefill, decode, (r, p, d) = fleet
    decode.stats = replace(
        decode.stats, num_running=4, num_waiting=1, kv_cache_usage=0.6,
        num_requests_peak=9, kv_cache_usage_peak=0.8,
    )  # fmt: skip
    prefill.stats = replace(
        prefill.stats, prefill_tokens_pending=300, prefill_tokens_waiting=200, num_running=2
    )
    router.time_to_first_token.observe(0.2)
    source = ScrapeSource(fixed([r], {"prefill": {"p0": p}, "decode": {"d0": d}}), window_s=30)
    signals = source.read(now=1000.0)
    assert signals.sampled_at == 1000.0 and signals.window_s == 30
    dec, pre = signals.pools["decode"], signals.pools["prefill"]
    assert (dec.reporting, dec.running, dec.waiting, dec.kv_usage_sum) == (1, 4, 1, 0.6)
    assert pre.prefill_backlog_tokens == 500 and pre.running == 2  # admitted and queued
    assert dec.pods["d0"].running == 4 and dec.pods["d0"].kv_usage == 0.6
    assert (dec.requests_peak, dec.kv_usage_peak_sum) == (9, 0.8)  # the worker's peak gauges
    assert dec.prompt_tokens_per_s is None and dec.busy_fraction is None
    assert signals.ttft_s is None and signals.request_rate is None  # one scrape: no window yet


def test_second_read_gives_rates_and_router_quantiles(fleet: Fleet) -> None:
    router, prefill, decode, (r, p, d) = fleet
    router.time_to_first_token.observe(9.0)  # before the window: not in the quantile
    source = ScrapeSource(
        fixed([r], {"prefill": {"p0": p}, "decode": {"d0": d}}), percentile=0.9, window_s=10
    )
    source.read(now=100.0)
    prefill.stats = replace(prefill.stats, prompt_tokens_total=5000, busy_seconds_total=7.5)
    decode.stats = replace(decode.stats, generation_tokens_total=400, busy_seconds_total=2.0)
    for ttft in [0.03] * 8 + [0.3] * 2:  # 10 requests: p90 = rank 9 inside (0.25, 0.5]
        router.time_to_first_token.observe(ttft)
        router.e2e_request_latency.observe(1.0)
    for tpot in (0.02, 0.04):
        router.time_per_output_token.observe(tpot)
        router.inter_token_latency.observe(tpot)
    signals = source.read(now=110.0)
    pre, dec = signals.pools["prefill"], signals.pools["decode"]
    assert pre.prompt_tokens_per_s == pytest.approx(500.0)
    assert pre.busy_fraction == pytest.approx(0.75)
    assert dec.generation_tokens_per_s == pytest.approx(40.0)
    assert dec.busy_fraction == pytest.approx(0.2)
    assert signals.request_rate == pytest.approx(1.0)
    # cumulative: 8 up to 0.04 (and 0.25), 10 up to 0.5; rank 9 is half-way into (0.25, 0.5]
    assert signals.ttft_s == pytest.approx(0.25 + 0.25 * (9 - 8) / (10 - 8))
    assert signals.tpot_s is not None and 0.025 < signals.tpot_s <= 0.05
    assert signals.itl_s == pytest.approx(signals.tpot_s)


def test_rates_cover_at_least_the_window(fleet: Fleet) -> None:
    _, prefill, _, (r, p, d) = fleet
    source = ScrapeSource(fixed([r], {"prefill": {"p0": p}, "decode": {"d0": d}}), window_s=20)
    for now, total in [(0.0, 0), (10.0, 100), (20.0, 200), (30.0, 1200)]:
        prefill.stats = replace(prefill.stats, prompt_tokens_total=total)
        signals = source.read(now=now)
    # baseline is the scrape at t=10 (20 s before t=30): (1200 - 100) / 20
    assert signals.pools["prefill"].prompt_tokens_per_s == pytest.approx(55.0)


def test_a_worker_restart_counts_its_new_totals_as_growth(fleet: Fleet) -> None:
    _, _, decode, (r, p, d) = fleet
    source = ScrapeSource(fixed([r], {"prefill": {"p0": p}, "decode": {"d0": d}}), window_s=10)
    decode.stats = replace(decode.stats, generation_tokens_total=9000)
    source.read(now=0.0)
    restarted = FakeWorker("decode")  # a new process on the same address
    restarted.stats = replace(restarted.stats, generation_tokens_total=50)
    d.target = restarted
    signals = source.read(now=10.0)
    assert signals.pools["decode"].generation_tokens_per_s == pytest.approx(5.0)


def test_targets_that_do_not_answer_are_not_reporting(fleet: Fleet) -> None:
    _, _, _, (r, p, d) = fleet
    extra = FakeWorker("decode")
    with serving(extra) as (d1,):
        source = ScrapeSource(
            fixed([r], {"prefill": {"p0": p}, "decode": {"d0": d, "d1": d1}}), timeout_s=1.0
        )
        assert source.read(now=0.0).pools["decode"].reporting == 2
        d1.status = 500
        signals = source.read(now=5.0)
        assert signals.pools["decode"].reporting == 1 and set(signals.pools["decode"].pods) == {
            "d0"
        }
        d1.stop()
        r.stop()  # no router answering: the source goes on with the workers alone
        signals = source.read(now=10.0)
        assert signals.pools["decode"].reporting == 1
        assert signals.pools["prefill"].reporting == 1
        p.stop()
        d.stop()
        with pytest.raises(MetricsUnavailable) as failed:
            source.read(now=15.0)
    assert failed.value.reason == "ScrapeFailed"
    assert d.url in failed.value.message and "/metrics" in failed.value.message


def test_a_worker_still_loading_is_not_a_reporting_replica(fleet: Fleet) -> None:
    """It answers /metrics (its HTTP server is up) with no engine series: counted, it would
    average its idle 0 into the pool's busy time and hide that it cannot serve yet."""
    _, prefill, decode, (r, p, d) = fleet
    loading = FakeWorker("prefill", loading=True)
    assert b"phasefleet_num_requests_running" not in loading.render()
    assert b"phasefleet_time_to_first_token_seconds" in loading.render()  # the server's own
    with serving(loading) as (p1,):
        source = ScrapeSource(fixed([r], {"prefill": {"p0": p, "p1": p1}, "decode": {"d0": d}}))
        source.read(now=0.0)
        prefill.stats = replace(prefill.stats, busy_seconds_total=9.0)
        pre = source.read(now=10.0).pools["prefill"]
        assert (pre.reporting, set(pre.pods)) == (1, {"p0"})
        assert pre.busy_fraction == pytest.approx(0.9)
        loading.loading = False
        assert source.read(now=20.0).pools["prefill"].reporting == 2
        for worker in (prefill, loading, decode):
            worker.loading = True
        with pytest.raises(MetricsUnavailable) as failed:
            source.read(now=30.0)
    assert failed.value.reason == "NoSamples"
    assert "none has loaded its model yet" in failed.value.message


def test_without_a_router_latencies_come_from_the_answering_workers() -> None:
    prefill, worker = FakeWorker("prefill"), FakeWorker("both")
    with serving(prefill, worker) as (p, w):
        source = ScrapeSource(fixed([], {"prefill": {"p0": p}, "worker": {"w0": w}}))
        source.read(now=0.0)
        prefill.metrics.time_to_first_token.observe(5.0)  # internal prefill-only requests
        worker.metrics.time_to_first_token.observe(0.03)
        worker.metrics.e2e_request_latency.observe(0.4)
        signals = source.read(now=10.0)
    assert signals.ttft_s is not None and 0.02 < signals.ttft_s <= 0.04
    assert signals.request_rate == pytest.approx(0.1)


def test_no_worker_targets_is_no_samples() -> None:
    source = ScrapeSource(lambda: ScrapeTargets(routers=("http://127.0.0.1:9",), workers={}))
    with pytest.raises(MetricsUnavailable) as failed:
        source.read(now=0.0)
    assert failed.value.reason == "NoSamples"


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="percentile"):
        ScrapeSource(lambda: ScrapeTargets(), percentile=90)
    with pytest.raises(ValueError, match="window_s"):
        ScrapeSource(lambda: ScrapeTargets(), window_s=0)


def test_scaled_to_zero_the_router_says_how_many_requests_it_holds() -> None:
    router = RouterMetrics("tiny")
    router.set_held("worker", 0)
    with serving(router) as servers:
        source = ScrapeSource(fixed(servers, {"worker": {}}))
        assert source.read(now=0.0).held == {"worker": 0.0}
        router.set_held("worker", 3)
        signals = source.read(now=1.0)
    assert signals.held == {"worker": 3.0} and signals.pools == {}
    assert signals.busy


class WorkerWithoutPeaks:
    """A worker image from before the peak gauges: the same text without their series."""

    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker

    def render(self) -> bytes:
        lines = self.worker.render().decode().splitlines(keepends=True)
        return "".join(line for line in lines if "_peak" not in line).encode()


def test_workers_without_peak_gauges_give_no_peaks_not_zero() -> None:
    """None, so the decode terms size on the snapshot alone; 0 would read as a calm peak."""
    decode = FakeWorker("decode")
    decode.stats = replace(decode.stats, num_running=4, kv_cache_usage=0.6)
    assert b"phasefleet_num_requests_peak" in decode.render()
    with serving(WorkerWithoutPeaks(decode)) as (server,):
        signals = ScrapeSource(fixed([], {"decode": {"d0": server}})).read(now=0.0)
    pool = signals.pools["decode"]
    assert (pool.reporting, pool.running, pool.kv_usage_sum) == (1, 4, 0.6)
    assert (pool.requests_peak, pool.kv_usage_peak_sum) == (None, None)
