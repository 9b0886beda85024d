"""StepPlan: a step's inputs worked out on the host, as numpy arrays and plain numbers, before
anything touches the device (the model runner sends them in one copy, `HostStaging`).

The work is O(tokens of the step + blocks new since the last step): block tables are not
rebuilt, only appended to (`BlockTables`), and a decode's slot and context length come from its
position. Plain Python and numpy: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from phasefleet.engine.block_table import BlockTables
from phasefleet.engine.scheduler import ScheduledRequest

DECODE_PAD_SLACK = 1.25  # torch path: a decode group may gather this much more than it needs


@dataclass
class DecodeGroupPlan:
    start: int  # index of its first request among the decodes (= in the flat batch)
    size: int  # requests in the group
    width: int  # blocks each gathers: the longest member's
    first_block: int | None  # size 1 with consecutive block ids: read a view, no gather


@dataclass
class PrefillPlan:
    start: int  # index of its first query token in the flat batch
    q_len: int  # query tokens this step
    ctx_len: int  # tokens it attends to, cached prefix plus this chunk
    row: int  # its row in the block tables
    num_blocks: int  # blocks covering ctx_len


@dataclass
class StepArrays:
    """What the forward pass needs, on every tensor-parallel rank (no scheduler objects)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64: block_id * block_size + offset
    decode_rows: np.ndarray  # [B_dec] int64: each decode's block-table row
    decode_ctx: np.ndarray  # [B_dec] int64: tokens each decode attends to
    groups: list[DecodeGroupPlan]  # torch decode path only (else empty)
    prefills: list[PrefillPlan]
    # [S] int64: flat index of each sampling request's last token; a request with a draft has
    # 1 + len(draft) rows here, its last known token's and each draft token's, in order
    sample_index: np.ndarray
    pool_index: np.ndarray  # [P] int64: flat index of each embedding request's last token
    lora_slots: np.ndarray  # [T] int64: each token's LoRA slot, -1 for none (engine/lora.py)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_rows)

    def arrays(self) -> StepArrays:
        """The StepArrays part alone (a StepPlan's requests stay with the scheduler)."""
        return StepArrays(**{f.name: getattr(self, f.name) for f in fields(StepArrays)})


@dataclass
class StepPlan(StepArrays):
    batch: list[ScheduledRequest]  # flat order: decodes (shortest context first), then prefills
    sampled: list[ScheduledRequest]  # the sampling requests, in sample_index's order
    pooled: list[ScheduledRequest]  # the embedding requests done this step, in pool_index's


@dataclass
class RankStep:
    """One step as each rank of a worker runs it: rank 0 plans it and sends it to the others."""

    arrays: StepArrays
    table_updates: tuple[np.ndarray, np.ndarray] | None  # BlockTables.pending_updates()
    graph: bool  # a decode-only step through the decode graphs
    logit_spans: list[tuple[int, int]]  # [start, end) rows of the hidden states whose logits
    # are wanted besides the sampled ones (prompt logprobs)


def plan_step(
    scheduled: list[ScheduledRequest], tables: BlockTables, block_size: int, group: bool
) -> StepPlan:
    """The plan for one SchedulerOutput's requests; `group`: split decodes into groups for the
    torch attention path. Writes new block ids into `tables` (their device copy is pending)."""
    bs = block_size
    decodes = sorted((s for s in scheduled if s.num_tokens == 1), key=lambda s: s.start)
    prefills = [s for s in scheduled if s.num_tokens > 1]
    n_dec = len(decodes)
    ids, pos, slots, rows = [], [], [], []
    adapters = [np.array([s.request.lora_slot for s in decodes], np.int64)]
    for s in decodes:
        p = s.start
        ids.append(s.request.token_ids(p, p + 1)[0])
        pos.append(p)
        slots.append(s.block_ids[p // bs] * bs + p % bs)
        rows.append(tables.row(s.request.request_id, s.block_ids, p // bs + 1))
    parts_ids, parts_pos, parts_slots = (
        [np.array(ids, np.int64)],
        [np.array(pos, np.int64)],
        [np.array(slots, np.int64)],
    )
    plans, offset = [], n_dec
    for s in prefills:
        end = s.start + s.num_tokens
        nb = -(-end // bs)
        row = tables.row(s.request.request_id, s.block_ids, nb)
        chunk = np.arange(s.start, end, dtype=np.int64)
        known = s.request.token_ids(s.start, end - len(s.draft))
        parts_ids.append(np.array(known + s.draft, np.int64))
        parts_pos.append(chunk)
        parts_slots.append(tables.host[row, chunk // bs].astype(np.int64) * bs + chunk % bs)
        adapters.append(np.full(s.num_tokens, s.request.lora_slot, np.int64))
        plans.append(PrefillPlan(offset, s.num_tokens, end, row, nb))
        offset += s.num_tokens
    batch = decodes + prefills
    sample_index: list[int] = []
    sampled, pool_index, pooled, end = [], [], [], 0
    for s in batch:
        end += s.num_tokens
        if s.sample and s.request.embed:
            pool_index.append(end - 1)
            pooled.append(s)
        elif s.sample:
            sample_index += range(end - 1 - len(s.draft), end)
            sampled.append(s)
    ctx = [p + 1 for p in pos]
    return StepPlan(
        batch=batch,
        input_ids=np.concatenate(parts_ids),
        positions=np.concatenate(parts_pos),
        slots=np.concatenate(parts_slots),
        decode_rows=np.array(rows, np.int64),
        decode_ctx=np.array(ctx, np.int64),
        groups=_groups(ctx, rows, tables, bs) if group else [],
        prefills=plans,
        sample_index=np.array(sample_index, np.int64),
        pool_index=np.array(pool_index, np.int64),
        lora_slots=np.concatenate(adapters),
        sampled=sampled,
        pooled=pooled,
    )


def _groups(ctx: list[int], rows: list[int], tables: BlockTables, bs: int) -> list[DecodeGroupPlan]:
    """Split decodes (sorted by context length) into runs whose padded gather stays within
    DECODE_PAD_SLACK of what they actually need."""
    blocks = [-(-c // bs) for c in ctx]
    groups = []
    i = 0
    while i < len(blocks):
        j, needed = i + 1, blocks[i]
        while j < len(blocks) and (j - i + 1) * blocks[j] <= DECODE_PAD_SLACK * (
            needed + blocks[j]
        ):
            needed += blocks[j]
            j += 1
        width = blocks[j - 1]
        first = None
        if j - i == 1:
            row = tables.host[rows[i], :width]
            if width == 1 or bool(np.all(np.diff(row) == 1)):
                first = int(row[0])
        groups.append(DecodeGroupPlan(i, j - i, width, first))
        i = j
    return groups
