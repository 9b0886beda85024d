"""PrometheusSource: Signals from PromQL over the series the chart's PodMonitor scrapes.

Series are selected by the labels Prometheus adds to each pod's samples (`namespace`, and
`inferenceservice` copied from the pod label phasefleet.dev/inferenceservice) and by the metrics'
own `role` label: `router` for the users' latencies, the engine role for each pool. Worker pods
being deleted (draining their last streams) are left out by their `pod` label, as the direct
scrape leaves them out: they are no longer part of the pool's capacity.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from phasefleet.api.contract import PEAK_WINDOW_S, POOL_ENGINE_ROLE, ROUTER_ROLE
from phasefleet.api.contract import Metric as M
from phasefleet.autoscale.signals import (
    NO_SAMPLES,
    MetricsUnavailable,
    PodLoad,
    PoolSignals,
    Signals,
)

URL_SETTING = "the chart value prometheus.url (PHASEFLEET_PROMETHEUS_URL)"
# A bad status, a query Prometheus refused, or a body that is not its API's JSON.
QUERY_ERRORS = (PrometheusApiClientException, requests.RequestException, ValueError, KeyError)


class PrometheusSource:
    def __init__(
        self,
        url: str,
        namespace: str,
        service: str,
        pools: Iterable[str],  # pool roles: prefill and decode, or worker
        percentile: float = 0.9,
        window_s: float = 60.0,
        timeout_s: float = 5.0,
        leaving: Callable[[], Collection[str]] = frozenset,  # names of pods being deleted
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Prometheus url must start with http:// or https://, got {url!r}")
        if not 0.0 < percentile < 1.0:
            raise ValueError(f"percentile must be between 0 and 1, got {percentile}")
        if window_s < 1:
            raise ValueError(f"window_s must be >= 1 second, got {window_s}")
        pool_list = list(pools)
        unknown = [p for p in pool_list if p not in POOL_ENGINE_ROLE]
        if unknown:
            raise ValueError(f"pools must be among {sorted(POOL_ENGINE_ROLE)}, got {unknown}")
        self.url = url.rstrip("/")
        self.namespace = namespace
        self.service = service
        self.engine_roles = {POOL_ENGINE_ROLE[p].value: p for p in pool_list}  # engine role -> pool
        self.percentile = percentile
        self.window_s = window_s  # seconds the rates and quantiles cover
        self.leaving = leaving
        # One quick retry on a dropped connection; the caller's next interval is the real retry.
        retry = Retry(total=1, backoff_factor=0.1, status_forcelist=())
        self.client = PrometheusConnect(self.url, retry=retry, timeout=timeout_s)

    def selector(self, role: str, leaving: Collection[str] = ()) -> str:
        """The label matchers of this service's series with metric label `role` (a regex),
        without those of the pods named in `leaving`."""
        matchers = (
            f'namespace="{_quote(self.namespace)}",inferenceservice="{_quote(self.service)}",'
            f'role=~"{role}"'
        )
        if leaving:
            names = "|".join(re.escape(name) for name in sorted(leaving))
            matchers += f',pod!~"{_quote(names)}"'
        return matchers

    def queries(self, leaving: Collection[str] = ()) -> dict[str, str]:
        """Every PromQL query `read` runs, by the name `read` uses for its result; worker
        series of the pods in `leaving` are left out."""
        router = self.selector(ROUTER_ROLE)
        workers = self.selector("|".join(self.engine_roles), leaving)
        w = f"[{int(self.window_s)}s]"
        backlog = f"{M.PREFILL_TOKENS_PENDING}|{M.PREFILL_TOKENS_WAITING}"

        def peak(gauge: str) -> str:
            """Each pod's peak gauge, summed: it covers its last PEAK_WINDOW_S, so over a longer
            window its highest value over the rest of the window is read too (a burst between
            two decisions an interval of 60 s apart still counts)."""
            series = f"{gauge}{{{workers}}}"
            rest = int(self.window_s) - PEAK_WINDOW_S
            if rest > 0:
                series = f"max_over_time({series}[{rest}s])"
            return f"sum by (role) ({series})"

        def quantile(histogram: str) -> str:
            return (
                f"histogram_quantile({self.percentile}, "
                f"sum by (le) (rate({histogram}_bucket{{{router}}}{w})))"
            )

        return {
            "ttft": quantile(M.TIME_TO_FIRST_TOKEN),
            "tpot": quantile(M.TIME_PER_OUTPUT_TOKEN),
            "itl": quantile(M.INTER_TOKEN_LATENCY),
            "request_rate": f"sum(rate({M.E2E_REQUEST_LATENCY}_count{{{router}}}{w}))",
            "kv_usage_sum": f"sum by (role) ({M.KV_CACHE_USAGE_PERC}{{{workers}}})",
            # admitted and queued prompts' tokens: both gauges in one sum, so a worker that
            # exports only the first still counts
            "prefill_backlog": f'sum by (role) ({{__name__=~"{backlog}",{workers}}})',
            "prompt_rate": f"sum by (role) (rate({M.PROMPT_TOKENS_TOTAL}{{{workers}}}{w}))",
            "generation_rate": f"sum by (role) (rate({M.GENERATION_TOKENS_TOTAL}{{{workers}}}{w}))",
            "busy": f"avg by (role) (rate({M.ENGINE_BUSY_SECONDS_TOTAL}{{{workers}}}{w}))",
            "running": f"sum by (role) ({M.NUM_REQUESTS_RUNNING}{{{workers}}})",
            "waiting": f"sum by (role) ({M.NUM_REQUESTS_WAITING}{{{workers}}})",
            "requests_peak": peak(M.NUM_REQUESTS_PEAK),
            "kv_usage_peak_sum": peak(M.KV_CACHE_USAGE_PEAK_PERC),
            "pod_running": f"{M.NUM_REQUESTS_RUNNING}{{{workers}}}",
            "pod_kv": f"{M.KV_CACHE_USAGE_PERC}{{{workers}}}",
            "sampled_at": f"max(timestamp({M.NUM_REQUESTS_RUNNING}{{{workers}}}))",
            "held": f"sum by ({M.ROUTER_HELD_POOL_LABEL}) ({M.ROUTER_REQUESTS_HELD}{{{router}}})",
        }

    def read(self, now: float) -> Signals:
        """Signals as of Prometheus' newest samples; `now` is unused (Prometheus evaluates at its
        own time, and `sampled_at` is on the Unix clock)."""
        queries = self.queries(self.leaving())
        results = {name: self._query(promql) for name, promql in queries.items()}
        pod_running = results["pod_running"]
        held = _by_label(results["held"], M.ROUTER_HELD_POOL_LABEL)
        if not pod_running and results["held"]:  # scaled to zero: the router's series remain
            return Signals(sampled_at=now, window_s=self.window_s, held=held)
        if not pod_running:
            raise MetricsUnavailable(
                NO_SAMPLES,
                f"Prometheus at {self.url} has no {M.NUM_REQUESTS_RUNNING} series for "
                f"inferenceservice {self.namespace}/{self.service}: check that it scrapes the "
                "worker pods (the chart's PodMonitor) and that the workers are ready.",
            )
        by_role = {name: _by_role(results[name]) for name in results}
        pools = {}
        for role, pool in self.engine_roles.items():
            running = _by_pod(pod_running, role)
            kv = _by_pod(results["pod_kv"], role)
            pools[pool] = PoolSignals(
                reporting=len(running),
                kv_usage_sum=by_role["kv_usage_sum"].get(role),
                prefill_backlog_tokens=by_role["prefill_backlog"].get(role),
                prompt_tokens_per_s=by_role["prompt_rate"].get(role),
                generation_tokens_per_s=by_role["generation_rate"].get(role),
                busy_fraction=by_role["busy"].get(role),
                running=by_role["running"].get(role),
                waiting=by_role["waiting"].get(role),
                requests_peak=by_role["requests_peak"].get(role),
                kv_usage_peak_sum=by_role["kv_usage_peak_sum"].get(role),
                pods={p: PodLoad(running=n, kv_usage=kv.get(p, 0.0)) for p, n in running.items()},
            )
        sampled_at = _scalar(results["sampled_at"])
        return Signals(
            sampled_at=sampled_at if sampled_at is not None else now,
            window_s=self.window_s,
            pools=pools,
            ttft_s=_scalar(results["ttft"]),
            tpot_s=_scalar(results["tpot"]),
            itl_s=_scalar(results["itl"]),
            request_rate=_scalar(results["request_rate"]),
            held=held,
        )

    def _query(self, promql: str) -> list[dict[str, Any]]:
        try:
            result = self.client.custom_query(promql)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise MetricsUnavailable(
                "PrometheusUnreachable",
                f"Prometheus at {self.url} did not answer ({type(exc).__name__}): check "
                f"{URL_SETTING} and that Prometheus is running.",
            ) from exc
        except (
            PrometheusApiClientException,
            requests.RequestException,
            ValueError,
            KeyError,
        ) as exc:
            raise MetricsUnavailable(
                "PrometheusError",
                f"Prometheus at {self.url} failed the query {promql!r} ({_short(exc)}): check "
                f"that {URL_SETTING} points at a Prometheus server's API.",
            ) from exc
        if not isinstance(result, list):
            raise MetricsUnavailable(
                "PrometheusError",
                f"Prometheus at {self.url} answered {promql!r} with a {type(result).__name__}, "
                f"not a vector: check that {URL_SETTING} points at a Prometheus server's API.",
            )
        return result


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 200 else f"{text[:200]}..."


def _value(sample: Mapping[str, Any]) -> float | None:
    """An instant-vector sample's value; None for NaN (e.g. a quantile with no observations)."""
    value = float(sample["value"][1])
    return None if math.isnan(value) else value


def _scalar(result: list[dict[str, Any]]) -> float | None:
    return _value(result[0]) if result else None


def _by_role(result: list[dict[str, Any]]) -> dict[str, float]:
    return _by_label(result, "role")


def _by_label(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    out = {}
    for sample in result:
        key, value = sample["metric"].get(label), _value(sample)
        if key is not None and value is not None:
            out[key] = value
    return out


def _by_pod(result: list[dict[str, Any]], role: str) -> dict[str, float]:
    """Per pod (the `pod` label, or `instance` where a static config gave none)."""
    out = {}
    for sample in result:
        labels = sample["metric"]
        value = _value(sample)
        if labels.get("role") == role and value is not None:
            out[labels.get("pod") or labels.get("instance", "")] = value
    return out
