"""Kubernetes pod discovery for Prometheus, served over Prometheus' HTTP service discovery.

Debian's Prometheus is built without `kubernetes_sd_configs` (its client-go is not packaged),
so the harness does that discovery itself: each GET lists the pods of the given namespaces
from the API server and answers with one target per container port, labelled with the
`__meta_kubernetes_*` labels Prometheus' own `role: pod` discovery gives them. A scrape config
with `http_sd_configs` pointing here then relabels them exactly as it would with Kubernetes
discovery (e.g. the chart's PodMonitor relabelings).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from e2e.harness.kubeapi import KubeApi

META = "__meta_kubernetes_"


def _name(key: str) -> str:
    """A label or annotation key as Prometheus writes it in a meta label name."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def pod_targets(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """HTTP SD target groups for one pod, as Kubernetes discovery (role: pod) labels them; a
    pod without an IP has none."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    ip = status.get("podIP")
    if not ip:
        return []
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    common = {
        f"{META}namespace": meta["namespace"],
        f"{META}pod_name": meta["name"],
        f"{META}pod_ip": ip,
        f"{META}pod_uid": meta.get("uid", ""),
        f"{META}pod_node_name": spec.get("nodeName", ""),
        f"{META}pod_phase": status.get("phase", ""),
        f"{META}pod_ready": "true" if ready else "false",
    }
    for key, value in (meta.get("labels") or {}).items():
        common[f"{META}pod_label_{_name(key)}"] = value
        common[f"{META}pod_labelpresent_{_name(key)}"] = "true"
    for key, value in (meta.get("annotations") or {}).items():
        common[f"{META}pod_annotation_{_name(key)}"] = value
        common[f"{META}pod_annotationpresent_{_name(key)}"] = "true"
    groups = []
    for container in spec.get("containers") or []:
        for port in container.get("ports") or []:
            number = port["containerPort"]
            labels = {
                **common,
                f"{META}pod_container_name": container["name"],
                f"{META}pod_container_port_name": port.get("name", ""),
                f"{META}pod_container_port_number": str(number),
                f"{META}pod_container_port_protocol": port.get("protocol", "TCP"),
            }
            groups.append({"targets": [f"{ip}:{number}"], "labels": labels})
    return groups


@dataclass
class PodDiscovery:
    """An HTTP SD endpoint over the pods of `namespaces`; `url` goes into `http_sd_configs`."""

    api: KubeApi
    namespaces: list[str]
    server: ThreadingHTTPServer | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        if self.server is None:
            raise RuntimeError("PodDiscovery is not started")
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}/targets"

    def targets(self) -> list[dict[str, Any]]:
        out = []
        for namespace in self.namespaces:
            for pod in self.api.get(f"/api/v1/namespaces/{namespace}/pods")["items"]:
                out.extend(pod_targets(pod))
        return out

    def start(self) -> None:
        discovery = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = json.dumps(discovery.targets()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one request a second: no log line each

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
