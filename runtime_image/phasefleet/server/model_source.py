"""Where `--model` comes from. In order:

1. an existing Hugging Face folder (config.json): used as is;
2. a `.gguf` file, or a folder without config.json holding one: converted once to a Hugging
   Face folder in the engine's dtype (phasefleet.server.gguf_model);
3. a short name, `smollm2` or `tiny`: made here without the Hub (phasefleet.server.named_models);
4. a value shaped like a repo id (`name` or `org/name`): fetched from the Hub into its cache
   (phasefleet.server.hub), at `revision` (default: main).

Anything else comes back as is, for the caller's folder check to explain. Every failure raises
ModelFetchError (GGUFError is one) whose text is one line.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub.errors import HFValidationError

from phasefleet.server.gguf_model import GGUFError, find_gguf, gguf_folder
from phasefleet.server.hub import ModelFetchError, fetch_model
from phasefleet.server.named_models import NAMES, named_model_folder

__all__ = ["GGUFError", "ModelFetchError", "resolve_model", "served_name"]

REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # spec.model.hf.repoId's pattern


def served_name(model: str, folder: str) -> str:
    """The default name clients use: a downloaded repo's id or a short name as given, a GGUF
    file's stem, else the folder's last part (never a host path)."""
    path = Path(model)
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return model if folder != model else Path(folder).name


def resolve_model(model: str, revision: str | None = None, dtype: str = "float32") -> str:
    """The local folder that `model` stands for; a GGUF file is converted to `dtype` (the
    engine's). Raises ModelFetchError (one line)."""
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return model
    gguf = find_gguf(path)
    if gguf is not None:
        return str(gguf_folder(gguf, dtype))
    if path.exists() or not REPO_ID.match(model) or model.startswith("."):
        return model
    if model in NAMES:
        return str(named_model_folder(model))
    try:
        return str(fetch_model(model, revision))
    except HFValidationError as exc:
        raise ModelFetchError(
            f"model {model!r} is not a folder here and not a valid Hugging Face repo id"
            f" ({exc}): fix --model or spec.model.hf.repoId"
        ) from exc
