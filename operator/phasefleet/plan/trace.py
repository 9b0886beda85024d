"""Request traces: when each request arrived, its prompt and output tokens.

Read from CSV or JSON Lines, one request per row, in either of two column sets:
- ours: `arrival_s` (seconds from any origin), `prompt_tokens`, `output_tokens`;
- as published: Azure's LLM inference CSV (`TIMESTAMP` as "YYYY-MM-DD HH:MM:SS.fffffff",
  `ContextTokens`, `GeneratedTokens`) and Mooncake's JSONL (`timestamp` in ms,
  `input_length`, `output_length`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping
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


@dataclass(frozen=True)
class Trace:
    name: str
    arrival: np.ndarray  # seconds from the first request, sorted, float64 [N]
    prompt: np.ndarray  # prompt tokens [N]
    output: np.ndarray  # output tokens, at least 1 [N]
    note: str = ""  # how it was made from the file

    @property
    def duration(self) -> float:
        return float(self.arrival[-1]) if len(self.arrival) else 0.0


def from_arrays(
    name: str, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, note: str = ""
) -> Trace:
    """Sorted by arrival, times from the first request, at least one output token each."""
    order = np.argsort(arrival, kind="stable")
    t = arrival[order] - arrival[order][0] if len(arrival) else arrival
    p = prompt[order].astype(np.int64)
    return Trace(name, t.astype(np.float64), p, np.maximum(output[order], 1).astype(np.int64), note)


def latencies(
    trace: Trace, first_token: np.ndarray, finish: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """TTFT and TPOT per request, seconds (TPOT 0 for one-token answers), from either fleet."""
    ttft = first_token - trace.arrival
    many = trace.output > 1
    tpot = np.zeros(len(ttft))
    tpot[many] = (finish[many] - first_token[many]) / (trace.output[many] - 1)
    return ttft, tpot


def read_trace(path: Path) -> Trace:
    """A trace file (.csv or .jsonl); ValueError naming the file and row when it is not one."""
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
    return from_arrays(path.stem, arrival, prompt, output, note=f"{path.name} ({kind} columns)")


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


def _seconds(kind: str, value: Any) -> float:
    if kind == "azure":  # 7 fractional digits; strptime takes at most 6
        return datetime.strptime(str(value)[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    if kind == "mooncake":
        return float(value) / 1000
    return float(value)
