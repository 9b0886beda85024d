"""BlockTables and HostStaging on their own: rows written by what is new, reused and rewritten;
device updates that reproduce the host table; one upload of mixed arrays, growing as needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phasefleet.engine.block_table import BlockTables
from phasefleet.engine.staging import HostStaging

CPU = torch.device("cpu")


def apply_pending(tables: BlockTables) -> None:
    pending = tables.pending_updates()
    if pending is not None:
        index, values = pending
        tables.apply(torch.from_numpy(index), torch.from_numpy(values))


def test_a_row_gets_only_the_blocks_new_since_last_time() -> None:
    tables = BlockTables(max_rows=3, max_blocks=8, device=CPU, separate=True)
    blocks = [7, 3]
    row = tables.row("a", blocks, 2)
    assert row == 1 and tables.host[1, :2].tolist() == [7, 3]
    first = tables.pending_updates()
    assert first is not None and first[0].tolist() == [8, 9] and first[1].tolist() == [7, 3]
    blocks.append(5)  # the scheduler's live list grows
    assert tables.row("a", blocks, 3) == 1
    index, values = tables.pending_updates() or (None, None)
    assert index is not None and values is not None
    assert index.tolist() == [10] and values.tolist() == [5]  # the new block only
    assert tables.row("a", blocks, 3) == 1 and tables.pending_updates() is None


def test_device_updates_reproduce_the_host_table() -> None:
    tables = BlockTables(max_rows=4, max_blocks=6, device=CPU, separate=True)
    lists = {"a": [1, 2], "b": [9], "c": [4, 5, 6]}
    for rid, ids in lists.items():
        tables.row(rid, ids, len(ids))
    apply_pending(tables)
    lists["a"] += [3, 8]
    tables.row("a", lists["a"], 4)
    tables.release("b")
    tables.row("d", [11, 12], 2)  # takes b's row, whose stale entries it overwrites
    apply_pending(tables)
    assert torch.equal(tables.device_table, torch.from_numpy(tables.host))
    assert tables.row("d", [11, 12], 2) == 2


def test_a_new_table_for_the_same_request_rewrites_its_row() -> None:
    tables = BlockTables(max_rows=2, max_blocks=4, device=CPU, separate=False)
    tables.row("a", [1, 2, 3], 3)
    readmitted = [6, 7]  # after a preemption: a new list
    row = tables.row("a", readmitted, 2)
    assert tables.host[row, :2].tolist() == [6, 7]
    assert tables.device_table is not None and tables.device_table[row, 0] == 6  # same memory


def test_rows_run_out_and_a_table_too_long_is_refused() -> None:
    tables = BlockTables(max_rows=1, max_blocks=2, device=CPU, separate=False)
    tables.row("a", [1], 1)
    with pytest.raises(RuntimeError, match="more running requests than block table rows"):
        tables.row("b", [2], 1)
    tables.release("a")
    tables.row("b", [2], 1)  # the row came back
    with pytest.raises(ValueError, match="needs 3 blocks, the table holds 2"):
        tables.row("b", [2, 3, 4], 3)
    assert tables.host[0].tolist() == [0, 0]  # the null row is never handed out


def test_one_upload_of_mixed_arrays_that_grows_its_buffer() -> None:
    staging = HostStaging(CPU, copy=True, capacity=16)
    arrays: list[np.ndarray] = [
        np.arange(5, dtype=np.int64),
        np.array([1.5, -2.0], dtype=np.float32),
        np.array([True, False, True]),
        np.arange(7, dtype=np.int32),
    ]
    for a in arrays:
        staging.add(a)
    got = staging.upload()  # 40 + 8 + 3 + 28 bytes, aligned: more than 16
    assert [t.dtype for t in got] == [torch.int64, torch.float32, torch.bool, torch.int32]
    for t, a in zip(got, arrays, strict=True):
        assert t.tolist() == a.tolist()
    device = staging._dev
    assert device is not None and all(
        t.untyped_storage().data_ptr() == device.untyped_storage().data_ptr() for t in got
    )
    staging.add(np.array([42], dtype=np.int64))
    assert staging.upload()[0].tolist() == [42]  # the queue starts empty each step
    with pytest.raises(ValueError, match="staging takes"):
        staging.add(np.array([1], dtype=np.uint16))
