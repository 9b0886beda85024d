"""Does a live object already hold what we would apply? (drift detection, no API calls)

The comparison is semantic, so a settled object compares equal to what the operator would
apply: the API server normalises quantities ("1.5Gi" is stored as "1536Mi"), fills in defaults
(extra keys in `live`), and other managers may own fields of their own (an extra port, label or
env var: extra items in keyed lists). Fields the operator stops setting are caught by the
`phasefleet.dev/applied-hash` annotation each child carries (see children.stamp).
"""

from __future__ import annotations

from typing import Any

from phasefleet.api.base import quantity

# Keys that identify an item of a Kubernetes list-map (containers, env, volumes, ports, ...).
LIST_KEYS = ("name", "mountPath", "containerPort", "port")
QUANTITY_FIELDS = {"limits", "requests"}  # maps whose values are resource quantities


def _list_key(items: list[Any]) -> str | None:
    for key in LIST_KEYS:
        if items and all(isinstance(i, dict) and key in i for i in items):
            return key
    return None


def contains(live: Any, desired: Any, quantities: bool = False) -> bool:
    """True when every field of `desired` is in `live` with the same meaning.

    Dicts: `live` may hold more keys; an empty desired value may be absent. Lists of objects
    with a key (name, mountPath, port): matched by key, `live` may hold more items. Other
    lists: item by item, same length. Scalars compare as strings (the server turns 1 into "1"),
    and values in `limits` / `requests` as quantities.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return live is None and not desired
        return all(
            contains(live.get(k), v, quantities or k in QUANTITY_FIELDS)
            if k in live
            else v in ({}, [], None)
            for k, v in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(live, list):
            return live is None and not desired
        key = _list_key(desired)
        if key is None:
            return len(live) == len(desired) and all(
                contains(lv, dv) for lv, dv in zip(live, desired, strict=True)
            )
        by_key = {i.get(key): i for i in live if isinstance(i, dict)}
        return all(contains(by_key.get(d[key]), d) for d in desired)
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is live
    if str(live) == str(desired):
        return True
    if quantities:
        ours, theirs = quantity(desired), quantity(live)
        return ours is not None and ours == theirs
    return False


def in_sync(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether applying `desired` over `live` would change nothing the operator owns."""
    return contains(live, desired)
