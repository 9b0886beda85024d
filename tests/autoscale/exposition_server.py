"""Localhost HTTP servers that answer GET /metrics with whatever text a test sets, and the
worker's and router's own metrics classes to render that text."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from phasefleet.engine.outputs import EngineStats
from phasefleet.server.metrics import WorkerMetrics

IDLE = EngineStats(
    num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=10, num_total_blocks=10,
    prefill_tokens_pending=0, num_preemptions_total=0, prefix_cache_queries_total=0,
    prefix_cache_hits_total=0, prompt_tokens_total=0, generation_tokens_total=0,
)  # fmt: skip


@dataclass
class FakeWorker:
    """A WorkerMetrics whose engine stats the test sets."""

    role: str = "both"
    stats: EngineStats = field(default_factory=lambda: replace(IDLE))
    loading: bool = False  # the engine has no stats yet, as while the model loads
    metrics: WorkerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = WorkerMetrics(
            "tiny", self.role, lambda: None if self.loading else self.stats
        )

    def render(self) -> bytes:
        return self.metrics.render()


class Renders(Protocol):
    def render(self) -> bytes: ...


class MetricsServer:
    """GET /metrics answers `target.render()`, or `status` with no body when that is not 200."""

    def __init__(self, target: Renders) -> None:
        self.target = target
        self.status = 200
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server: ThreadingHTTPServer | None = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Close the port: later GETs are refused."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@contextmanager
def serving(*targets: Renders) -> Iterator[list[MetricsServer]]:
    servers: list[MetricsServer] = []
    try:
        servers.extend(MetricsServer(t) for t in targets)
        yield servers
    finally:
        for s in servers:
            s.stop()


def _handler(target: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/metrics" or target.status != 200:
                self.send_response(404 if self.path != "/metrics" else target.status)
                self.end_headers()
                return
            body = target.target.render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler
