"""The phase boundary: whether a decode worker's request is prefilled on a prefill worker
(remote) or by the decode worker itself (local). The worker and the planner's simulator both
decide with `PhaseBoundary.remote`, so what the simulator measures is what the fleet runs.

Fixed rule: a prompt goes remote when at least `min_tokens` of it are not in the decode
worker's prefix cache (a shorter one costs the decode batch little and saves the hand-off).

Adaptive rule (`adaptive`, off by default: it gains in the simulator and lost 5% goodput on the
CPU fleet), from the prefill worker the router picked, its backlog in seconds of its own
measured prefill throughput:
- backlog over `busy_backlog_s`: the prompt is prefilled here, whatever its length, if this
  decode worker has room: the prompt tokens it already holds unprefilled plus this prompt stay
  within `local_max_tokens`, and, while requests run on it, their TPOT with this prefill stays
  under `tpot_share` of the TPOT target (no target known: the token bound alone). TPOT is a
  mean over a request's tokens, so the prefill's time is spread over a typical answer: recent
  inter-token latency + prefill time / typical answer length (with no answer seen yet, the
  whole prefill time counts);
- backlog zero (the prefill worker is idle): prompts from `idle_min_tokens` go remote, so the
  decode batch is spared prefill the idle pool could do;
- backlog unknown (no throughput measured yet): the fixed rule.
A `min_tokens` of 0 hands off every prompt, whatever the load (the adaptive rule is off).
"""

from __future__ import annotations

from dataclasses import dataclass

from phasefleet.api.contract import DEFAULT_REMOTE_PREFILL_MIN_TOKENS

DEFAULT_BUSY_BACKLOG_S = 0.5
DEFAULT_IDLE_MIN_TOKENS = 128
DEFAULT_LOCAL_MAX_TOKENS = 4096
DEFAULT_TPOT_SHARE = 0.8


@dataclass(frozen=True)
class LocalLoad:
    """What the decode worker knows of itself when a request arrives."""

    prefill_tokens: int  # prompt tokens admitted or queued here, not yet prefilled
    itl_s: float | None = None  # its recent inter-token latency; None: not measured yet
    tpot_target_s: float | None = None  # the service's TPOT target; None: none set
    prefill_s: float = 0.0  # this prompt's prefill time (at the prefill pool's measured speed)
    output_tokens: float | None = None  # a typical answer's length here; None: not known yet
    decoding: int = 1  # requests running here (none: no TPOT to keep)


@dataclass(frozen=True)
class PhaseBoundary:
    min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS
    adaptive: bool = False  # off by default: bench/RESULTS.md "The phase boundary follows the load"
    busy_backlog_s: float = DEFAULT_BUSY_BACKLOG_S
    idle_min_tokens: int = DEFAULT_IDLE_MIN_TOKENS
    local_max_tokens: int = DEFAULT_LOCAL_MAX_TOKENS
    tpot_share: float = DEFAULT_TPOT_SHARE

    def __post_init__(self) -> None:
        if self.min_tokens < 0 or self.idle_min_tokens < 0 or self.local_max_tokens < 0:
            raise ValueError(
                "min_tokens, idle_min_tokens and local_max_tokens must be >= 0, got "
                f"{self.min_tokens}, {self.idle_min_tokens}, {self.local_max_tokens}"
            )
        if self.busy_backlog_s <= 0:
            raise ValueError(f"busy_backlog_s must be > 0, got {self.busy_backlog_s}")
        if not 0 < self.tpot_share <= 1:
            raise ValueError(f"tpot_share must be in (0, 1], got {self.tpot_share}")

    def fixed(self, uncached: int) -> bool:
        """The fixed rule: remote when `uncached` prompt tokens reach min_tokens."""
        return uncached >= self.min_tokens

    def remote(self, uncached: int, backlog_s: float | None, local: LocalLoad) -> bool:
        """True: prefill this prompt (`uncached` tokens not in the local prefix cache) on the
        prefill worker whose backlog is `backlog_s` seconds (None: not known)."""
        if not self.adaptive or self.min_tokens == 0 or backlog_s is None:
            return self.fixed(uncached)  # 0: every prompt is handed off, whatever the load
        if backlog_s > self.busy_backlog_s and self.has_room(uncached, local):
            return False
        if backlog_s <= 0:
            return uncached >= min(self.idle_min_tokens, self.min_tokens)
        return self.fixed(uncached)

    def has_room(self, uncached: int, local: LocalLoad) -> bool:
        """The decode worker may take this prefill without its TPOT leaving the target."""
        if local.prefill_tokens + uncached > self.local_max_tokens:
            return False
        if local.tpot_target_s is None or local.decoding == 0:
            return True
        spread = local.prefill_s / max(1.0, local.output_tokens or 1.0)
        return (local.itl_s or 0.0) + spread <= self.tpot_share * local.tpot_target_s
