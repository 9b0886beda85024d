"""Where `--lora-modules NAME=SOURCE` adapters come from: SOURCE is a PEFT adapter folder, or a
Hugging Face repo id (`org/name`, optionally `@revision`) fetched into the model's Hub cache
(server/hub.py). No heavy imports: the CLI checks the flag before loading anything."""

from __future__ import annotations

import re
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = [ADAPTER_CONFIG, "adapter_model.safetensors"]  # all an adapter needs
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][\w.:-]{0,99}$")  # a request's `model`
HUB_SOURCE = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(@(?P<revision>[\w./-]+))?$")


def parse_lora_modules(values: list[str], served_name: str | None) -> dict[str, str]:
    """NAME=SOURCE entries as name -> source; ValueError naming the bad entry. A source that
    is not a repo id must be a folder holding adapter_config.json."""
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, source = value.partition("=")
        if not sep or not source:
            raise ValueError(
                f"--lora-modules entries are NAME=PATH or NAME=org/repo, got {value!r}"
            )
        if not ADAPTER_NAME.match(name):
            raise ValueError(
                f"--lora-modules: {name!r} is not a usable name (letters, digits, '.', '_', ':',"
                " '-'; up to 100)"
            )
        if name in adapters or name == served_name:
            raise ValueError(f"--lora-modules: the name {name!r} is used twice")
        if hub_source(source) is None and not (Path(source) / ADAPTER_CONFIG).is_file():
            raise ValueError(
                f"--lora-modules {name}: {source} has no {ADAPTER_CONFIG} (a PEFT LoRA adapter "
                "folder, as save_pretrained writes it, or a Hugging Face repo id org/name)"
            )
        adapters[name] = source
    return adapters


def hub_source(source: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of `org/name[@revision]` that is not a local path; None for
    anything else."""
    if source.startswith((".", "/", "~")) or Path(source).exists():
        return None
    match = HUB_SOURCE.match(source)
    return None if match is None else (match["repo"], match["revision"])


def resolve_adapters(adapters: dict[str, str]) -> dict[str, str]:
    """name -> local folder, fetching repo ids from the Hub; ModelFetchError (one line)."""
    from phasefleet.server.hub import fetch_adapter

    folders = {}
    for name, source in adapters.items():
        repo = hub_source(source)
        folders[name] = source if repo is None else str(fetch_adapter(*repo))
    return folders
