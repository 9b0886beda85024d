"""Operator at scale: N InferenceServices on the real control plane (KWOK nodes), all Ready.

Starts the e2e control plane, installs the chart (operator Deployment at 0) and runs
`phasefleet operator` as a process with the chart's ServiceAccount, as the e2e tests do. Then:

1. creates N small disaggregated InferenceServices at once and records, per object, the time
   from `kubectl create` to Ready=True, and the operator's own reconcile time (from its log);
2. waits while nothing changes and counts writes (resourceVersion changes) to children and
   InferenceServices: a settled operator should make none;
3. restarts the operator and counts writes again (resume must be idempotent);
4. reports the operator's resident memory (steady and peak).

`--load-seconds S`: after the writes are counted, S seconds of the settled fleet's API load,
as the API server's own request counts by verb and resource (`apiserver_request_total`: the
control plane's requests too), the operator's API bytes and its CPU time. With
`--autoscaled`, every service has `spec.autoscaling.enabled` (decisions every 5 s, the
default) and the operator reads metrics from a Prometheus URL where nothing listens (KWOK's
pods serve no /metrics), so the load is the autoscalers' own.

    .venv/bin/python bench/operator_scale.py --count 50 --unrelated 0 --load-seconds 60 --autoscaled

Before the operator starts, `--unrelated` Deployments (replicas 0, no phasefleet label) are
created in another namespace, and after the services are Ready every one of them is
annotated: a cluster's other workloads. The operator watches its children through a
server-side label selector, so neither should reach it; the bench relays the operator's
connections to the API server through a counting TCP proxy and reports the bytes while they
were listed at start and while they changed.

    .venv/bin/python bench/operator_scale.py --count 50 --unrelated 500
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.harness.controlplane import ControlPlane, tools_bin_dir  # noqa: E402
from e2e.harness.phasefleet_operator import (  # noqa: E402
    Operator,
    install_chart,
    service_account_kubeconfig,
)
from e2e.harness.process import free_port  # noqa: E402
from e2e.harness.wait import wait_for  # noqa: E402

NAMESPACE = "scale"
NOISE_NAMESPACE = "noise"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def service(i: int, autoscaled: bool = False) -> dict[str, Any]:
    # No resource requests and a toleration: the workers spread over all three KWOK nodes
    # (110 pods each), the routers land on the CPU node.
    pool = {"replicas": 1, "tolerations": [GPU_TOLERATION]}
    spec: dict[str, Any] = {
        "model": {"image": {"path": "/models/tiny"}}, "prefill": pool, "decode": pool,
    }  # fmt: skip
    if autoscaled:
        spec["autoscaling"] = {"enabled": True}
    return {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": f"svc-{i:03d}"},
        "spec": spec,
    }


def request_counts(cluster: ControlPlane) -> dict[str, float]:
    """The API server's requests so far by "VERB resource" (apiserver_request_total)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        sub = f"/{labels['subresource']}" if labels.get("subresource") else ""
        key = f"{labels['verb']} {labels['resource']}{sub}"
        counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def unrelated_deployment(i: int) -> dict[str, Any]:
    labels = {"app": f"other-{i:03d}"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"other-{i:03d}", "labels": labels},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "app", "image": "registry.example/app:1"}]},
            },
        },
    }


class CountingProxy:
    """A TCP relay between the operator and the API server that counts the bytes each way.

    TLS passes through untouched (the API server's certificate names 127.0.0.1, whatever the
    port), so this is the operator's whole API traffic: requests, responses, watch streams.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = 0  # bytes from the API server to the operator
        self.sent = 0  # bytes from the operator to the API server
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, downstream: bool) -> None:
        try:
            while data := source.recv(65536):
                with self.lock:
                    if downstream:
                        self.received += len(data)
                    else:
                        self.sent += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def total(self) -> int:
        with self.lock:
            return self.received + self.sent

    def route(self, kubeconfig: Path) -> None:
        """Points the kubeconfig's server at this proxy."""
        config = json.loads(kubeconfig.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        kubeconfig.write_text(json.dumps(config))


def api_port(kubeconfig: Path) -> int:
    server = json.loads(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    return int(server.rsplit(":", 1)[1])


def versions(cluster: ControlPlane) -> dict[str, str]:
    out = {}
    for kind in ("inferenceservices", "deployments", "services", "poddisruptionbudgets"):
        items = json.loads(cluster.kubectl("get", kind, "-n", NAMESPACE, "-o", "json").stdout)
        for item in items["items"]:
            out[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return out


def observed(cluster: ControlPlane) -> tuple[set[str], set[str]]:
    """(names the operator has written status for, names that are Ready)."""
    items = json.loads(
        cluster.kubectl("get", "inferenceservices", "-n", NAMESPACE, "-o", "json").stdout
    )["items"]
    handled, ready = set(), set()
    for item in items:
        status = item.get("status") or {}
        if "observedGeneration" in status:
            handled.add(item["metadata"]["name"])
        if any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
        ):
            ready.add(item["metadata"]["name"])
    return handled, ready


def wait_idle(operator: Operator, quiet_s: float = 10.0, timeout_s: float = 900.0) -> float:
    """Waits until the operator has run no event handler for `quiet_s` (kopf logs each one):
    every child's and pod's event after a create runs its owner's pass, so the operator is
    busy well after the last service is Ready. Returns that moment (monotonic)."""
    deadline = time.monotonic() + timeout_s
    last, last_change = -1, time.monotonic()
    while time.monotonic() < deadline:
        handled = operator.log().count("Handler '")
        now = time.monotonic()
        if handled != last:
            last, last_change = handled, now
        elif now - last_change >= quiet_s:
            return last_change
        time.sleep(1.0)
    raise TimeoutError(f"the operator ran event handlers for {timeout_s:.0f} s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--settle-seconds", type=float, default=30.0)
    parser.add_argument("--unrelated", type=int, default=500, help="other Deployments")
    parser.add_argument(
        "--load-seconds", type=float, default=0.0, help="measure the settled API load this long"
    )
    parser.add_argument("--autoscaled", action="store_true", help="autoscale every service")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="phasefleet-bench-"))
    cluster = ControlPlane(workdir=workdir / "cluster", bin_dir=tools_bin_dir())
    cluster.start()
    try:
        install_chart(cluster)
        cluster.kubectl("create", "namespace", NAMESPACE)
        cluster.kubectl("create", "namespace", NOISE_NAMESPACE)
        if args.unrelated:
            noise = "\n---\n".join(
                json.dumps(unrelated_deployment(i)) for i in range(args.unrelated)
            )
            cluster.kubectl("create", "-n", NOISE_NAMESPACE, "-f", "-", input=noise)
        kubeconfig = service_account_kubeconfig(cluster, workdir / "operator.kubeconfig")
        proxy = CountingProxy(api_port(kubeconfig))
        proxy.route(kubeconfig)
        flags = ["--prometheus-url", f"http://127.0.0.1:{free_port()}"] if args.autoscaled else []
        operator = Operator(cluster, kubeconfig, workdir, *flags)
        operator.start()
        time.sleep(5)  # initial lists and watches are done
        idle_rss = operator.rss_mib()
        startup_bytes = proxy.total()

        created: dict[str, float] = {}
        ready_at: dict[str, float] = {}
        manifest = "\n---\n".join(
            json.dumps(service(i, args.autoscaled)) for i in range(args.count)
        )
        start = time.monotonic()
        cluster.kubectl("create", "-n", NAMESPACE, "-f", "-", input=manifest)
        for i in range(args.count):
            created[f"svc-{i:03d}"] = start

        handled_at: dict[str, float] = {}

        def all_ready() -> bool:
            now = time.monotonic()
            handled, ready = observed(cluster)
            for name in handled:
                handled_at.setdefault(name, now)
            for name in ready:
                ready_at.setdefault(name, now)
            return len(ready_at) == args.count

        wait_for(all_ready, 900, f"{args.count} InferenceServices Ready")
        total = time.monotonic() - start
        to_ready = [ready_at[n] - created[n] for n in created]
        to_handled = [handled_at.get(n, ready_at[n]) - created[n] for n in created]
        loaded_rss = operator.rss_mib()
        reconcile_times = [
            float(m) for m in re.findall(r"reconciled \(create\) in ([0-9.]+)s", operator.log())
        ]

        idle_after = wait_idle(operator) - start
        before = versions(cluster)
        time.sleep(args.settle_seconds)
        settled_writes = sum(1 for k, v in versions(cluster).items() if before.get(k) != v)

        load: dict[str, float] = {}
        if args.load_seconds:
            requests_before, bytes_before = request_counts(cluster), proxy.total()
            pid = operator.component.pid
            assert pid is not None
            cpu_before, load_start = cpu_seconds(pid), time.monotonic()
            time.sleep(args.load_seconds)
            elapsed = time.monotonic() - load_start
            cpu = cpu_seconds(pid) - cpu_before
            after = request_counts(cluster)
            load = {
                key: (after[key] - requests_before.get(key, 0.0)) / elapsed
                for key in after
                if after[key] > requests_before.get(key, 0.0)
            }
            load["operator API bytes"] = (proxy.total() - bytes_before) / elapsed
            load["operator CPU share of a core"] = cpu / elapsed

        bytes_before = proxy.total()
        churn_start = time.monotonic()
        if args.unrelated:
            cluster.kubectl(
                "annotate", "deployments", "--all", "-n", NOISE_NAMESPACE,
                "bench.phasefleet.dev/touched=1", "--overwrite",
            )  # fmt: skip
        time.sleep(5)
        churn_seconds = time.monotonic() - churn_start
        churn_bytes = proxy.total() - bytes_before
        quiet_start = proxy.total()
        time.sleep(churn_seconds)
        quiet_bytes = proxy.total() - quiet_start

        peak_rss = operator.peak_rss_mib()
        log_size = len(operator.log())
        operator.stop()
        restart = time.monotonic()
        operator.start()
        wait_for(
            lambda: operator.log()[log_size:].count("reconciled (resume)") >= args.count,
            600,
            "resume handlers",
        )
        resumed = time.monotonic() - restart
        time.sleep(5)
        restart_writes = sum(1 for k, v in versions(cluster).items() if before.get(k) != v)
        restarted_rss = operator.rss_mib()
        operator.stop()
    finally:
        cluster.destroy()

    objects = len(before)
    print(
        f"## Operator scale ({args.count} InferenceServices, {objects} of their objects,"
        f" {args.unrelated} unrelated Deployments)\n"
    )
    print("| measure | value |")
    print("|---|---|")
    print(f"| all {args.count} Ready after create | {total:.1f} s |")
    print(
        f"| create -> children applied and first status, p50 / max | "
        f"{statistics.median(to_handled):.1f} / {max(to_handled):.1f} s |"
    )
    print(
        f"| create -> Ready per object, p50 / p95 / max | {statistics.median(to_ready):.1f} / "
        f"{percentile(to_ready, 0.95):.1f} / {max(to_ready):.1f} s |"
    )
    if reconcile_times:
        ms = [t * 1000 for t in reconcile_times]
        print(
            f"| operator reconcile (create handler) p50 / p95 / max | "
            f"{statistics.median(ms):.0f} / {percentile(ms, 0.95):.0f} / {max(ms):.0f} ms |"
        )
    print(f"| operator idle after create (its last event handler) | {idle_after:.1f} s |")
    print(f"| writes while settled ({args.settle_seconds:.0f} s) | {settled_writes} |")
    print(f"| operator restart: all {args.count} resumed after | {resumed:.1f} s |")
    print(f"| writes caused by the restart | {restart_writes} |")
    rss = f"{idle_rss:.0f} / {loaded_rss:.0f} / {peak_rss:.0f} / {restarted_rss:.0f}"
    print(f"| operator RSS: idle / {args.count} Ready / peak / after restart | {rss} MiB |")
    print(f"| operator API traffic, start until idle (5 s) | {startup_bytes:,} bytes |")
    print(
        f"| operator API traffic while the {args.unrelated} unrelated Deployments changed"
        f" ({churn_seconds:.0f} s) / the same time quiet"
        f" | {churn_bytes:,} / {quiet_bytes:,} bytes |"
    )
    if load:
        what = "autoscaled" if args.autoscaled else "not autoscaled"
        print(f"\n### API load: {args.count} services, {what}, {args.load_seconds:.0f} s\n")
        print("| what | per second |")
        print("|---|---|")
        for key, value in sorted(load.items(), key=lambda kv: -kv[1]):
            print(f"| {key} | {value:,.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
