"""Where `--model` comes from: a local folder when one exists, else a Hugging Face repo id.

The rule: if the value names an existing directory it is used as is (a repo id never is
looked up then); otherwise a value shaped like a repo id (`name` or `org/name`) is fetched
from the Hub into the cache (phasefleet.server.hub), at `revision` (default: main). Anything
else is left to the caller's folder check.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub.errors import HFValidationError

from phasefleet.server.hub import ModelFetchError, fetch_model

REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # spec.model.hf.repoId's pattern


def served_name(model: str, folder: str) -> str:
    """The default name clients use: a downloaded repo's id, else the folder's last part
    (never a host path)."""
    return model if folder != model else Path(folder).name


def resolve_model(model: str, revision: str | None = None) -> str:
    """The local folder that `model` stands for; raises ModelFetchError (one line).

    A value that is neither an existing folder nor shaped like a repo id comes back as is, for
    the caller's folder check to explain."""
    if Path(model).is_dir() or not REPO_ID.match(model) or model.startswith("."):
        return model
    try:
        return str(fetch_model(model, revision))
    except HFValidationError as exc:
        raise ModelFetchError(
            f"model {model!r} is not a folder here and not a valid Hugging Face repo id"
            f" ({exc}): fix --model or spec.model.hf.repoId"
        ) from exc
