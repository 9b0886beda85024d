"""When a local fleet restarts a crashed process, and when it gives up: the kubelet's
CrashLoopBackOff, with a limit the kubelet does not have.

A slot is a worker's name (`decode-1`) or `router`; its restarts keep the name. A slot that
crashes (its process exits unasked, whatever the exit code or signal) starts again after a
back-off that doubles with each crash in a row: `first_backoff_s`, then twice that, up to
`max_backoff_s`. A run that served (healthy) for `reset_after_s` ends the row, so its next crash
waits `first_backoff_s` again. `max_crashes` crashes of one slot within `crash_window_s` make the
fleet give up: the kubelet would keep trying for ever, but a local fleet has no one watching its
events, and a loop that never ends hides a broken setup (a deleted model, a lost GPU) behind a
fleet that looks alive. Pure: every call takes `now`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

DEFAULT_FIRST_BACKOFF_S = 1.0
DEFAULT_MAX_CRASHES = 5


@dataclass(frozen=True)
class RestartConfig:
    first_backoff_s: float = DEFAULT_FIRST_BACKOFF_S  # seconds before a slot's first restart
    max_backoff_s: float = 30.0  # seconds: the longest back-off
    reset_after_s: float = 60.0  # seconds served after which a crash counts as the first again
    max_crashes: int = DEFAULT_MAX_CRASHES  # crashes of one slot within crash_window_s: give up
    crash_window_s: float = 600.0  # seconds

    def validate(self) -> None:
        if not 0 < self.first_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"--restart-backoff must be > 0 and at most {self.max_backoff_s:g} seconds,"
                f" got {self.first_backoff_s:g}"
            )
        if self.max_crashes < 1:
            raise ValueError(f"--max-crashes must be >= 1, got {self.max_crashes}")
        if self.reset_after_s <= 0 or self.crash_window_s <= 0:
            raise ValueError(
                f"reset_after_s and crash_window_s must be > 0 seconds, got"
                f" {self.reset_after_s:g} and {self.crash_window_s:g}"
            )


@dataclass(frozen=True)
class Verdict:
    """What follows one crash of a slot."""

    crashes_in_window: int  # this slot's crashes within crash_window_s, this one included
    delay_s: float | None  # seconds until the restart; None: the fleet gives up


@dataclass
class _Slot:
    crashes: deque[float] = field(default_factory=deque)  # crash times within the window
    in_a_row: int = 0  # crashes since the last run that served reset_after_s


class CrashLoop:
    def __init__(self, config: RestartConfig) -> None:
        config.validate()
        self.config = config
        self._slots: dict[str, _Slot] = {}

    def crashed(self, slot: str, now: float, served_s: float) -> Verdict:
        """Records a crash of `slot` at `now` (seconds) after it served `served_s` seconds
        (0 if it never became healthy)."""
        state = self._slots.setdefault(slot, _Slot())
        state.crashes.append(now)
        while now - state.crashes[0] > self.config.crash_window_s:
            state.crashes.popleft()
        state.in_a_row = 1 if served_s >= self.config.reset_after_s else state.in_a_row + 1
        count = len(state.crashes)
        if count >= self.config.max_crashes:
            return Verdict(count, None)
        delay = self.config.first_backoff_s * 2 ** min(state.in_a_row - 1, 30)
        return Verdict(count, min(delay, self.config.max_backoff_s))
