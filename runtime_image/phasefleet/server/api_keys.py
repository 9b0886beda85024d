"""The API keys of a worker or the router, as they are now: $PHASEFLEET_API_KEY's, and the
file's that $PHASEFLEET_API_KEY_FILE names, re-read when it changes (plain Python: the CLIs
import it before any web framework; server/auth.py checks requests against it)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from phasefleet.api.contract import API_KEY_ENV, API_KEY_FILE_ENV

RELOAD_S = 1.0  # the key file is looked at no more often
logger = logging.getLogger("phasefleet.auth")


def split_keys(text: str) -> tuple[str, ...]:
    return tuple(key.strip() for key in re.split(r"[,\n]", text) if key.strip())


class ApiKeys:
    """The keys a client may send: $PHASEFLEET_API_KEY's and, when $PHASEFLEET_API_KEY_FILE is
    set, that file's as it is now (re-read when its size or time changes; while it cannot be
    read, the keys read last)."""

    def __init__(
        self,
        fixed: tuple[str, ...] = (),
        path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """ValueError when the file cannot be read or holds no key (a typo, an empty Secret:
        better no start than a service open to all)."""
        self.fixed, self.path, self.clock = fixed, path, clock
        self._stamp: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self._from_file: tuple[str, ...] = ()
        if path is not None and not self._reload():
            raise ValueError(f"${API_KEY_FILE_ENV}: {path} cannot be read or holds no key")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ApiKeys:
        fixed = split_keys(environ.get(API_KEY_ENV, ""))
        path = environ.get(API_KEY_FILE_ENV, "").strip()
        return cls(fixed, Path(path) if path else None)

    def __bool__(self) -> bool:
        """Whether any key is needed at all."""
        return bool(self.fixed) or self.path is not None

    def current(self) -> tuple[str, ...]:
        if self.path is not None and self.clock() - self._checked >= RELOAD_S:
            self._reload()
        return self.fixed + self._from_file

    def _reload(self) -> bool:
        """Re-reads the file if it changed; False when it cannot be read or holds no key."""
        assert self.path is not None
        self._checked = self.clock()
        try:
            stat = self.path.stat()
            stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if stamp == self._stamp:
                return True
            keys = split_keys(self.path.read_text())
        except OSError as exc:
            logger.warning("API key file %s cannot be read (%s): the last keys stay", self.path,
                           exc.strerror)  # fmt: skip
            return False
        if not keys:
            logger.warning("API key file %s holds no key: the last keys stay", self.path)
            return False
        if self._stamp is not None:
            logger.info("API keys re-read from %s: %d key(s)", self.path, len(keys))
        self._stamp, self._from_file = stamp, keys
        return True
