"""How long each part of a worker's start-up took, in the order they ran: logged once the
engine is ready and exported as phasefleet_worker_startup_seconds{phase} (docs/engine.md,
"Start-up").

Phases: imports (torch, transformers, the server), model_fetch (a Hub download or a GGUF
conversion; absent for a folder), lora_fetch (adapters fetched from the Hub; only with
--lora-modules), config (config.json and the tokenizer), device_init (CUDA
only: creating the context), weights (read from the safetensors files into place),
cpu_linear_plan (the CPU's per-shape path choice, cached across processes), lora (adapters
read into their slots; only with adapters), kv_cache (sizing
and zeroing the KV pool, and allocating the prefix cache's host tier where there is one),
cuda_graphs (decode graph capture) and warm_up (the first steps, before the worker says it is
ready).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupTimes:
    """Seconds per phase; written by the thread that loads, read by scrapes (a lock)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def describe(self) -> str:
        """'imports 3.9 s, config 0.2 s, ... (total 5.1 s)'."""
        parts = self.seconds()
        text = ", ".join(f"{name} {s:.2f} s" for name, s in parts.items())
        return f"{text} (total {sum(parts.values()):.2f} s)"
