"""A container's last words, written where Kubernetes reads termination messages.

When a container exits, the kubelet copies the file at its `terminationMessagePath` (default
/dev/termination-log, at most 4096 bytes) into the pod's
`status.containerStatuses[].lastState.terminated.message`; the operator quotes that in the
InferenceService's Degraded condition. So a program that cannot go on writes one line there:
what failed and what to do about it. `$PHASEFLEET_TERMINATION_LOG` names another file (tests,
the e2e pod runner); outside a pod, where /dev/termination-log does not exist, nothing is
written (creating files in /dev is not ours to do).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

TERMINATION_LOG_ENV = "PHASEFLEET_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_BYTES = 4096  # the kubelet reads no more of the file than this

log = logging.getLogger(__name__)


def termination_log() -> Path | None:
    """Where the message goes: $PHASEFLEET_TERMINATION_LOG, else the kubelet's default file
    when it exists, else nowhere."""
    configured = os.environ.get(TERMINATION_LOG_ENV)
    if configured:
        return Path(configured)
    default = Path(DEFAULT_TERMINATION_LOG)
    return default if default.exists() else None


def one_line(message: str) -> str:
    """The message on one line, cut to what the kubelet keeps (whole characters)."""
    line = " ".join(message.split())
    return line.encode()[:MAX_BYTES].decode(errors="ignore")


def write_termination_message(message: str) -> None:
    """Replaces the termination message with `message`, on one line. A file that cannot be
    written is logged, never raised: the caller is already failing for a better reason."""
    path = termination_log()
    if path is None:
        return
    try:
        path.write_text(one_line(message) + "\n")
    except OSError as exc:
        log.warning("could not write the termination message to %s: %s", path, exc)


def fail(program: str, message: str, code: int = 1) -> int:
    """A fatal error: `program: message` on stderr and as the termination message. Returns
    `code`, the exit code to give."""
    print(f"{program}: {message}", file=sys.stderr)
    write_termination_message(message)
    return code
