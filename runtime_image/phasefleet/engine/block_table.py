"""BlockTables: every running request's block table, kept where attention reads it.

One row per running request in a [max_rows, max_blocks] int32 table on the device, mirrored on
the host. A request's scheduler table only grows while it runs (blocks appended), so each step
writes only the block ids that are new since its last step: a few per step, not the whole
table. A request that gets a new table (readmitted after a preemption) has its row rewritten.
Row 0 is all null blocks, for the padding lanes of a CUDA graph.

Plain numpy on the host; the device table is updated by the caller from `pending_updates()`
(flat indices and values, sent with the step's other inputs in one copy).
"""

from __future__ import annotations

import numpy as np
import torch

NULL_ROW = 0


class BlockTables:
    def __init__(
        self, max_rows: int, max_blocks: int, device: torch.device, separate: bool
    ) -> None:
        """`separate`: the device table is memory of its own, updated by copies (a GPU; tests
        set it on the CPU); else it is the host table itself."""
        self.max_blocks = max_blocks
        self.host = np.zeros((max_rows + 1, max_blocks), dtype=np.int32)  # row 0: null row
        self.device_table = (
            torch.zeros(self.host.shape, dtype=torch.int32, device=device)
            if separate
            else torch.from_numpy(self.host)
        )
        self._free = list(range(max_rows, 0, -1))  # pop() gives the lowest free row
        self._rows: dict[str, int] = {}  # request id -> row
        self._source: dict[str, list[int]] = {}  # request id -> the scheduler's live table
        self._written: dict[str, int] = {}  # request id -> block ids written to its row
        self._updates: list[np.ndarray] = []  # flat indices then values, by pairs
        self._mirror_only = not separate

    def row(self, request_id: str, block_ids: list[int], needed: int) -> int:
        """The request's row, holding at least its first `needed` blocks of `block_ids` (the
        scheduler's live list for it) once the pending updates are applied."""
        row = self._rows.get(request_id)
        if row is None or self._source[request_id] is not block_ids:
            if row is None:
                if not self._free:
                    raise RuntimeError("more running requests than block table rows")
                row = self._free.pop()
                self._rows[request_id] = row
            self._source[request_id] = block_ids
            self._written[request_id] = 0
        done = self._written[request_id]
        if needed > done:
            if needed > self.max_blocks:
                raise ValueError(
                    f"request {request_id} needs {needed} blocks, the table holds {self.max_blocks}"
                )
            new = np.asarray(block_ids[done:needed], dtype=np.int32)
            self.host[row, done:needed] = new
            if not self._mirror_only:
                start = row * self.max_blocks + done
                self._updates.append(np.arange(start, start + len(new), dtype=np.int64))
                self._updates.append(new)
            self._written[request_id] = needed
        return row

    def release(self, request_id: str) -> None:
        """Frees the request's row (finished or preempted); its stale entries are rewritten
        before anyone reads them."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._source.pop(request_id)
            self._written.pop(request_id)
            self._free.append(row)

    def pending_updates(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(flat indices int64, block ids int32) written on the host since the last call, for
        the device table (None when there are none, or on the CPU)."""
        if not self._updates:
            return None
        index = np.concatenate(self._updates[0::2])
        values = np.concatenate(self._updates[1::2])
        self._updates = []
        return index, values

    def apply(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Writes uploaded updates into the device table (a device op, no host work)."""
        self.device_table.view(-1).index_copy_(0, index, values)
