"""The router's settings (a dataclass: importable without fastapi, for the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field

from phasefleet.router.hold import DEFAULT_HOLD_SECONDS, DEFAULT_MAX_HELD
from phasefleet.router.policy import POLICIES
from phasefleet.server.api_keys import ApiKeys

DEFAULT_MAX_ATTEMPTS = 3  # workers tried per request
DEFAULT_REFRESH_INTERVAL = 1.0  # seconds; pool changes are seen within two of these


@dataclass
class RouterConfig:
    served_model_name: str
    policy: str  # policy.POLICIES
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # workers tried per request before giving up
    refresh_interval: float = DEFAULT_REFRESH_INTERVAL  # seconds between discovery + load polls
    internal_token: str | None = None  # the service's token: needed to name a prefill worker
    hold_seconds: float = DEFAULT_HOLD_SECONDS  # a request's longest wait for a ready worker
    max_held_requests: int = DEFAULT_MAX_HELD  # requests held per pool at once
    late_after_ms: int | None = None  # the TTFT target sent with each request: late prompts last
    tpot_target_ms: int | None = None  # the TPOT target sent to decode workers: phase boundary
    # keys a client must send (`Authorization: Bearer`, server/auth.py); none: open. A relayed
    # request carries the client's header; the router's own loads onto workers, the first key.
    api_keys: ApiKeys = field(default_factory=ApiKeys)

    def own_authorization(self) -> dict[str, str]:
        """The header of the router's own requests to workers (none without keys)."""
        keys = self.api_keys.current()
        return {"authorization": f"Bearer {keys[0]}"} if keys else {}

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.refresh_interval <= 0:
            raise ValueError(f"refresh_interval must be > 0 seconds, got {self.refresh_interval}")
        if self.hold_seconds < 0:
            raise ValueError(f"hold_seconds must be >= 0 (0: no holding), got {self.hold_seconds}")
        if self.max_held_requests < 1:
            raise ValueError(f"max_held_requests must be >= 1, got {self.max_held_requests}")
        if self.late_after_ms is not None and self.late_after_ms < 1:
            raise ValueError(f"late_after_ms must be >= 1 ms, got {self.late_after_ms}")
        if self.tpot_target_ms is not None and self.tpot_target_ms < 1:
            raise ValueError(f"tpot_target_ms must be >= 1 ms, got {self.tpot_target_ms}")
