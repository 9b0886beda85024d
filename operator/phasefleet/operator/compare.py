"""Does a live object already hold what we would apply? (drift detection, no API calls)"""

from __future__ import annotations

from typing import Any


def contains(live: Any, desired: Any) -> bool:
    """True when every field of `desired` is in `live` with the same value.

    The API server adds defaults and other managers' fields, so `live` may hold more. Scalars
    compare as strings, because the server normalises quantities (1 -> "1") and int-or-strings.
    Lists compare item by item and must have the same length.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return False
        return all(contains(lv, dv) for lv, dv in zip(live, desired, strict=True))
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is live
    return str(live) == str(desired)


def in_sync(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether applying `desired` over `live` would change nothing the operator owns."""
    return contains(live, desired)
