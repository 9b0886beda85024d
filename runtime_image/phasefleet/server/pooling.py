"""How a model's embeddings are pooled (POST /v1/embeddings, server/embeddings.py): the last
token's final hidden state, L2-normalized unless a sentence-transformers folder says otherwise.
Such a folder lists its modules in `modules.json` (Transformer, Pooling, Normalize, Dense...)
and its pooling in the Pooling module's `config.json`; what the worker cannot reproduce (mean or
CLS pooling, a Dense projection) is named in `refused`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODULES_FILE = "modules.json"
LAST_TOKEN_MODE = "pooling_mode_lasttoken"


@dataclass(frozen=True)
class Pooling:
    """How this model's embeddings are made: the last token's final hidden state, normalized
    or not; `refused` says why this model's cannot be (None: they can)."""

    normalize: bool = True
    refused: str | None = None
    hidden_size: int | None = None  # an embedding's width; None: not known (no check)

    @classmethod
    def of_model(cls, folder: str | Path, hidden_size: int) -> Pooling:
        """Read from a sentence-transformers folder's modules.json and its Pooling module's
        config.json; without modules.json, the last token, normalized (vLLM's default for a
        causal model). ValueError naming the file when one is not valid JSON."""
        modules = _json(Path(folder) / MODULES_FILE)
        if modules is None:
            return cls(hidden_size=hidden_size)
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ValueError(f"{Path(folder) / MODULES_FILE} is not a list of modules")
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        normalize = "Normalize" in kinds
        other = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
        if other:
            why = f"its {MODULES_FILE} adds {', '.join(other)} after pooling"
            return cls(normalize, why, hidden_size)
        pooling = kinds.get("Pooling")
        if pooling is None:
            return cls(normalize, None, hidden_size)
        path = Path(folder) / str(pooling.get("path", "")) / "config.json"
        config = _json(path) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object")
        modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v is True)
        if modes and modes != [LAST_TOKEN_MODE]:
            why = f"it pools by {', '.join(modes)}; only the last token is served"
            return cls(normalize, why, hidden_size)
        return cls(normalize, None, hidden_size)


def _json(path: Path) -> object | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
