"""The highest value of a quantity over a trailing window: the worker's peak gauges.

A burst of requests shorter than the autoscaler's interval fills a decode engine between two
scrapes and is gone by the next: a snapshot of the batch or of KV usage misses it. The engine
observes each step's values here and its gauges report the highest of the last PEAK_WINDOW_S;
the trace replay's simulated replicas keep theirs the same way.
"""

from __future__ import annotations

from collections import deque

from phasefleet.api.contract import PEAK_WINDOW_S


class WindowPeak:
    """The highest value observed over the last `window_s` seconds, kept per whole second
    (at most window_s + 1 entries, whatever the step rate)."""

    def __init__(self, window_s: int = PEAK_WINDOW_S) -> None:
        if window_s < 1:
            raise ValueError(f"window_s must be >= 1 second, got {window_s}")
        self.window_s = window_s
        self._seconds: deque[tuple[int, float]] = deque()  # (whole second, highest in it)

    def observe(self, value: float, now: float) -> None:
        second = int(now)
        if self._seconds and self._seconds[-1][0] >= second:
            last, highest = self._seconds[-1]
            self._seconds[-1] = (last, max(highest, value))
        else:
            self._seconds.append((second, value))
        self._expire(second)

    def peak(self, now: float) -> float:
        """The highest value of the last window_s seconds; 0 when none was observed. A read
        only, safe from another thread than the one observing (the worker's metrics)."""
        oldest = int(now) - self.window_s
        return max((v for s, v in list(self._seconds) if s > oldest), default=0.0)

    def _expire(self, second: int) -> None:
        while self._seconds and self._seconds[0][0] <= second - self.window_s:
            self._seconds.popleft()
