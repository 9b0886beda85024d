"""bench/ modules import each other by bare name (they run as scripts from bench/): the same
here, so the tests import the simulator as the replay does."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
