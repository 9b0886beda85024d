"""DrainingServer: uvicorn with a graceful SIGTERM, as Kubernetes sends before killing a pod.

On SIGTERM the worker keeps listening but answers /health and new requests with 503 (and
Retry-After), lets in-flight requests finish and, on a prefill worker, waits until the decode
workers have pulled and released every KV lease (or the leases expire), then shuts down and
exits 0. Requests still running
after `drain_timeout` seconds are cut off. A second SIGTERM, or SIGINT, shuts down at once the way
plain uvicorn does.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from phasefleet.server.state import WorkerState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: WorkerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout  # seconds
        self.drain_deadline: float | None = None  # time.monotonic() when draining gives up

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler: only set flags here. The signal is not re-raised after
        # shutdown (plain uvicorn re-raises it, which would turn a clean drain into exit -15).
        if sig == signal.SIGTERM and self.drain_deadline is None and not self.should_exit:
            self.state.draining = True
            self.drain_deadline = time.monotonic() + self.drain_timeout
            return
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            in_flight = self.state.engine.in_flight
            stats = self.state.engine.stats()
            leases = stats.num_kv_leases if stats is not None else 0
            if in_flight == 0 and leases == 0:
                logger.info("drained: no requests in flight and no KV leased, shutting down")
                self.should_exit = True
            elif time.monotonic() > self.drain_deadline:
                logger.warning(
                    "drain timeout: cutting off %d request(s) and %d KV lease(s)", in_flight, leases
                )
                self.should_exit = True
        return await super().on_tick(counter)
