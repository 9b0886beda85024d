"""Operator at scale: N InferenceServices on the real control plane (KWOK nodes), all Ready.

Starts the e2e control plane, installs the chart (operator Deployment at 0) and runs
`phasefleet operator` as a process with the chart's ServiceAccount, as the e2e tests do. Then:

1. creates N small disaggregated InferenceServices at once and records, per object, the time
   from `kubectl create` to Ready=True, and the operator's own reconcile time (from its log);
2. waits while nothing changes and counts writes (resourceVersion changes) to children and
   InferenceServices: a settled operator should make none;
3. restarts the operator and counts writes again (resume must be idempotent);
4. reports the operator's resident memory (steady and peak).

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
from e2e.harness.wait import wait_for  # noqa: E402
from e2e.test_operator_support import (  # noqa: E402
    Operator,
    install_chart,
    service_account_kubeconfig,
)

NAMESPACE = "scale"
NOISE_NAMESPACE = "noise"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def service(i: int) -> dict[str, Any]:
    # No resource requests and a toleration: the workers spread over all three KWOK nodes
    # (110 pods each), the routers land on the CPU node.
    pool = {"replicas": 1, "tolerations": [GPU_TOLERATION]}
    return {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": f"svc-{i:03d}"},
        "spec": {"model": {"image": {"path": "/models/tiny"}}, "prefill": pool, "decode": pool},
    }


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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--settle-seconds", type=float, default=30.0)
    parser.add_argument("--unrelated", type=int, default=500, help="other Deployments")
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
        operator = Operator(cluster, kubeconfig, workdir)
        operator.start()
        time.sleep(5)  # initial lists and watches are done
        idle_rss = operator.rss_mib()
        startup_bytes = proxy.total()

        created: dict[str, float] = {}
        ready_at: dict[str, float] = {}
        manifest = "\n---\n".join(json.dumps(service(i)) for i in range(args.count))
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

        time.sleep(5)
        before = versions(cluster)
        time.sleep(args.settle_seconds)
        settled_writes = sum(1 for k, v in versions(cluster).items() if before.get(k) != v)

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
