"""A model folder's tokenizer, without transformers' auto classes where the folder names its class.

`AutoTokenizer`'s module pulls in `torch._dynamo` (0.7 s of a worker's start-up on this CPU,
0.8-1.5 s on the GPU check's host: bench/RESULTS.md, "Worker start-up"). For a folder whose
tokenizer_config.json names its class and which holds tokenizer.json, the class AutoTokenizer
would pick is that class's fast version, so it is loaded directly; any other folder (no class
named, custom code in `auto_map`, no fast version) goes through AutoTokenizer as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def named_class(folder: Path) -> Any | None:
    """The fast tokenizer class the folder's tokenizer_config.json names, or None when
    AutoTokenizer has to decide."""
    config_path = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name or "auto_map" in config:
        return None
    import transformers

    fast = name if name.endswith("Fast") else f"{name}Fast"
    try:
        return getattr(transformers, fast)
    except (AttributeError, ImportError, RuntimeError):  # no such class, or a missing dependency
        return None


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer AutoTokenizer.from_pretrained(folder) gives, loaded without it when the
    folder names its class (see the module's docstring)."""
    cls = named_class(Path(folder))
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    return cls.from_pretrained(folder)


GENERATION_CONFIG_FILE = "generation_config.json"


def generation_config(folder: str | Path) -> dict[str, Any]:
    """The model's generation_config.json ({} when it has none); ValueError when it is not a
    JSON object."""
    path = Path(folder) / GENERATION_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a JSON object: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def eos_token_ids(folder: str | Path, hf_config: Any, tokenizer: Any) -> set[int]:
    """The tokens that end a sequence: the eos_token_id (one or a list) of the model's config,
    of its generation_config.json (where chat models name their end-of-turn tokens: Llama 3's
    <|eot_id|>, Phi-3's <|end|>, as transformers' generate and vLLM read it) and the
    tokenizer's."""
    ids: set[int] = set()
    from_generation = generation_config(folder).get("eos_token_id")
    sources = (getattr(hf_config, "eos_token_id", None), from_generation, tokenizer.eos_token_id)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    return ids
