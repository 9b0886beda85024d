"""Request traces: when each request arrived, its prompt and output tokens.

Read from CSV or JSON Lines, one request per row, in either of two column sets:
- ours: `arrival_s` (seconds from any origin), `prompt_tokens`, `output_tokens`;
- as published: Azure's LLM inference CSV (`TIMESTAMP` as "YYYY-MM-DD HH:MM:SS.fffffff",
  `ContextTokens`, `GeneratedTokens`) and Mooncake's JSONL (`timestamp` in ms,
  `input_length`, `output_length`).

A JSON Lines trace may also name each request's prompt blocks (`hash_ids`, as Mooncake's do: one
id per `block_tokens` prompt tokens, equal ids for equal prefixes), which lets the simulators
model the workers' prefix cache.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

# column set -> (arrival, prompt, output) keys
COLUMNS = {
    "ours": ("arrival_s", "prompt_tokens", "output_tokens"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
}
BLOCK_TOKENS = 512  # prompt tokens per hash id in Mooncake's traces


@dataclass(frozen=True)
class Trace:
    name: str
    arrival: np.ndarray  # seconds from the first request, sorted, float64 [N]
    prompt: np.ndarray  # prompt tokens [N]
    output: np.ndarray  # output tokens, at least 1 [N]
    note: str = ""  # how it was made from the file
    # each request's prompt blocks by id (equal ids: equal prefixes), or None: not known
    blocks: tuple[tuple[int, ...], ...] | None = None
    block_tokens: int = BLOCK_TOKENS  # prompt tokens per block id

    @property
    def duration(self) -> float:
        return float(self.arrival[-1]) if len(self.arrival) else 0.0


def from_arrays(
    name: str,
    arrival: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    note: str = "",
    blocks: Sequence[Sequence[int]] | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> Trace:
    """Sorted by arrival, times from the first request, at least one output token each."""
    order = np.argsort(arrival, kind="stable")
    t = arrival[order] - arrival[order][0] if len(arrival) else arrival
    p = prompt[order].astype(np.int64)
    o = np.maximum(output[order], 1).astype(np.int64)
    ids = None if blocks is None else tuple(tuple(blocks[k]) for k in order)
    return Trace(name, t.astype(np.float64), p, o, note, ids, block_tokens)


def latencies(
    trace: Trace, first_token: np.ndarray, finish: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """TTFT and TPOT per request, seconds (TPOT 0 for one-token answers), from either fleet."""
    ttft = first_token - trace.arrival
    many = trace.output > 1
    tpot = np.zeros(len(ttft))
    tpot[many] = (finish[many] - first_token[many]) / (trace.output[many] - 1)
    return ttft, tpot


def read_trace(path: Path, block_tokens: int = BLOCK_TOKENS) -> Trace:
    """A trace file (.csv or .jsonl); ValueError naming the file and row when it is not one.
    `block_tokens`: the prompt tokens each of a JSON Lines trace's `hash_ids` stands for."""
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            rows: list[Mapping[str, Any]] = list(csv.DictReader(f))
    elif path.suffix in (".jsonl", ".json"):
        with path.open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        raise ValueError(f"{path}: a trace is a .csv or .jsonl file, got {path.suffix or 'none'}")
    if not rows:
        raise ValueError(f"{path}: no requests")
    kind = _column_set(path, rows[0].keys())
    arrival, prompt, output = _columns(path, kind, rows)
    blocks = _blocks(path, rows) if any("hash_ids" in row for row in rows) else None
    note = f"{path.name} ({kind} columns{', hash_ids' if blocks else ''})"
    return from_arrays(path.stem, arrival, prompt, output, note, blocks, block_tokens)


def _column_set(path: Path, keys: Iterable[str]) -> str:
    present = set(keys)
    for kind, names in COLUMNS.items():
        if set(names) <= present:
            return kind
    wanted = "; ".join(", ".join(names) for names in COLUMNS.values())
    raise ValueError(f"{path}: columns {sorted(present)} are none of: {wanted}")


def _columns(
    path: Path, kind: str, rows: list[Mapping[str, Any]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    at, into, out = COLUMNS[kind]
    arrival, prompt, output = [], [], []
    for number, row in enumerate(rows, start=1):
        try:
            arrival.append(_seconds(kind, row[at]))
            prompt.append(int(row[into]))
            output.append(int(row[out]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: request {number}: {exc}") from None
        if prompt[-1] < 1 or output[-1] < 0:
            raise ValueError(f"{path}: request {number}: token counts must be positive")
    return np.array(arrival), np.array(prompt), np.array(output)


def _blocks(path: Path, rows: list[Mapping[str, Any]]) -> list[list[int]]:
    """Every request's `hash_ids`: a list of integers, in every row once one has them."""
    blocks = []
    for number, row in enumerate(rows, start=1):
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in ids
        ):
            raise ValueError(
                f"{path}: request {number}: hash_ids must be a list of integers (every request "
                "needs them once one has them)"
            )
        blocks.append(ids)
    return blocks


def _seconds(kind: str, value: Any) -> float:
    if kind == "azure":  # 7 fractional digits; strptime takes at most 6
        return datetime.strptime(str(value)[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    if kind == "mooncake":
        return float(value) / 1000
    return float(value)
