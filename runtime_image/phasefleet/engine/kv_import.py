"""The decode side of the hand-off in the engine: KV of a prompt computed by another worker,
loaded into this engine's blocks.

A request comes with the chunks that have arrived so far (consecutive blocks of its prompt from
`import_first_block` on; the blocks before are expected as prefix-cache hits here). While it
is `importing`, more chunks follow: each is written into the request's blocks as it arrives if
the request is admitted (its blocks allocated), else kept until admission. The scheduler admits
an importing request (its blocks reserved) but computes nothing for it until the import ends
(with the first token, when the prefill worker sent one); then it goes on from the last token
whose KV arrived, recomputing the rest of the prompt. Engine thread only.
"""

from __future__ import annotations

from phasefleet.engine.kv_cache_manager import KVCacheManager, cdiv
from phasefleet.engine.kv_transfer import KVChunk, KVLayout
from phasefleet.engine.model_runner import ModelRunner
from phasefleet.engine.request import Request, RequestStatus


class KVImports:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, layout: KVLayout) -> None:
        self.runner = runner
        self.kv = kv
        self.layout = layout
        self._pending: dict[str, list[KVChunk]] = {}  # request_id -> chunks not yet loaded
        self._floor: dict[str, int] = {}  # admitted: its prefix-cache hit blocks (never written)

    def check(self, chunks: list[KVChunk], first_block: int, num_prompt_tokens: int) -> int:
        """The prompt tokens `chunks` (from `first_block` on) make available from token 0, the
        blocks before being prefix-cache hits; ValueError naming what is wrong with them."""
        bs, end = self.layout.block_size, first_block
        for chunk in chunks:
            expected = self.layout.payload_bytes(chunk.num_blocks)
            if chunk.first_block != end or chunk.payload.numel() != expected:
                raise ValueError(
                    f"imported_kv chunks must be consecutive, each of num_blocks x "
                    f"{self.layout.block_bytes()} bytes; the chunk at block "
                    f"{chunk.first_block} (expected {end}) holds {chunk.payload.numel()} bytes"
                    f" for {chunk.num_blocks} blocks"
                )
            end = chunk.end_block
        if end > cdiv(num_prompt_tokens, bs):
            raise ValueError(
                f"imported_kv covers {end} blocks, more than the {num_prompt_tokens}-token "
                f"prompt's {cdiv(num_prompt_tokens, bs)}"
            )
        return min(num_prompt_tokens, end * bs) if chunks else 0

    def add(self, request_id: str, chunks: list[KVChunk]) -> None:
        self._pending[request_id] = list(chunks)

    def admitted(self, req: Request, num_hit_blocks: int) -> None:
        """Writes what has arrived into a just-admitted request's blocks past its hits."""
        self._floor[req.request_id] = num_hit_blocks
        for chunk in self._pending.pop(req.request_id, []):
            self._write(req, chunk)

    def dropped(self, request_id: str) -> None:
        """The import will not be used (a gap before it, all hits, preempted, finished)."""
        self._pending.pop(request_id, None)
        self._floor.pop(request_id, None)

    def arrive(self, req: Request, chunk: KVChunk) -> None:
        """The next chunk of an importing request; ValueError when it is not the next one (or
        not whole): nothing of it is used. Ignored once the import was dropped."""
        if req.request_id not in self._pending and req.request_id not in self._floor:
            return
        imported = req.num_imported_tokens
        after = cdiv(imported, self.layout.block_size) if imported else req.import_first_block
        req.num_imported_tokens = self.check([chunk], after, req.num_prompt_tokens)
        if req.status is RequestStatus.RUNNING:
            self._write(req, chunk)
        else:
            self._pending.setdefault(req.request_id, []).append(chunk)

    def _write(self, req: Request, chunk: KVChunk) -> None:
        table = self.kv.block_tables[req.request_id]
        last = cdiv(req.num_imported_tokens, self.layout.block_size)
        start = max(self._floor[req.request_id], chunk.first_block)
        end = min(last, chunk.end_block)
        if start < end:
            self.runner.write_kv(table[start:end], chunk.payload, start - chunk.first_block)
