"""Reading leased KV blocks out of the pool for a pull, in kv_transfer's wire order (layer-major:
each layer's keys, then its values, each [blocks, block_size, kv_heads, head_dim]; a worker whose
KV heads are split over tensor-parallel ranks sends each one's heads in turn, shard after shard).

A read is cut into chunks of at most `chunk_bytes` (CHUNK_BYTES by default): whole layers when
they are small (several layers gathered into one device buffer, then one copy), a layer's keys
or values in pieces of blocks when one alone is larger. On CUDA each chunk is gathered and
copied into a pinned host buffer on a stream of the exporter's own, so a pull waits for its own
copies, never for the step the engine has in flight (leased blocks are not written until
released, and the step that wrote them finished before the lease was made). On the CPU the
gather writes straight into the host buffer. Each yielded chunk's memory is reused by the next:
consume it (send, copy) first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from phasefleet.engine.kv_dtype import as_rows, select_rows

CHUNK_BYTES = 32 << 20


KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class KVExporter:
    def __init__(self, shards: list[KVCache]) -> None:
        """`shards`: the pool of each group of KV heads, in head order (one: all heads)."""
        self.shards = shards
        self.kv_caches = shards[0]
        self._stream: torch.cuda.Stream | None = None

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    @torch.inference_mode()
    def read(self, block_ids: list[int], chunk_bytes: int | None = None) -> Iterator[memoryview]:
        """The blocks' KV as raw bytes, in wire order, in chunks of at most chunk_bytes
        (default CHUNK_BYTES; one block more when a block is larger)."""
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        keys0 = self.kv_caches[0][0]
        device, n = keys0.device, len(block_ids)
        # one block of one layer's keys, every shard's heads
        block_bytes = len(self.shards) * keys0[0].numel() * keys0.element_size()
        stream = self._side_stream(device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            index = {
                c[0][0].device: torch.tensor(block_ids, dtype=torch.long).to(
                    c[0][0].device, non_blocking=True
                )
                for c in self.shards
            }
            layers = max(1, chunk_bytes // (2 * n * block_bytes))  # whole layers per chunk
            blocks = min(n, max(1, chunk_bytes // block_bytes))  # blocks per piece otherwise
            if 2 * n * block_bytes <= chunk_bytes:
                shards = len(self.shards)
                shape = (min(layers, len(self.kv_caches)), 2, shards, n, *keys0.shape[1:])
                yield from self._layer_groups(index, layers, shape, stream)
            else:
                yield from self._pieces(index, blocks, stream)

    def _buffers(
        self, shape: tuple[int, ...], stream: torch.cuda.Stream | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(where the gather writes, the host buffer a chunk is read from)."""
        dtype = self.kv_caches[0][0].dtype
        host = torch.empty(shape, dtype=dtype, pin_memory=stream is not None)
        if stream is None:
            return host, host
        return torch.empty(shape, dtype=dtype, device=self.kv_caches[0][0].device), host

    def _layer_groups(
        self,
        index: dict[torch.device, torch.Tensor],
        layers: int,
        shape: tuple[int, ...],
        stream: torch.cuda.Stream | None,
    ) -> Iterator[memoryview]:
        gathered, host = self._buffers(shape, stream)  # [layers, k/v, shards, n, bs, H, D]
        for start in range(0, len(self.kv_caches), layers):
            count = min(layers, len(self.kv_caches) - start)
            for s, caches in enumerate(self.shards):
                for i, (keys, values) in enumerate(caches[start : start + count]):
                    _gather(keys, index, gathered[i, 0, s])
                    _gather(values, index, gathered[i, 1, s])
            yield _send(gathered[:count], host[:count], stream)

    def _pieces(
        self, index: dict[torch.device, torch.Tensor], blocks: int, stream: torch.cuda.Stream | None
    ) -> Iterator[memoryview]:
        shape = (blocks, *self.kv_caches[0][0].shape[1:])
        gathered, host = self._buffers(shape, stream)  # [blocks, bs, H, D]
        n = len(next(iter(index.values())))
        for layer in range(len(self.kv_caches)):
            for which in (0, 1):
                for caches in self.shards:
                    cache = caches[layer][which]
                    for start in range(0, n, blocks):
                        part = {d: i[start : start + blocks] for d, i in index.items()}
                        count = min(blocks, n - start)
                        _gather(cache, part, gathered[:count])
                        yield _send(gathered[:count], host[:count], stream)


def _gather(
    cache: torch.Tensor, index: dict[torch.device, torch.Tensor], out: torch.Tensor
) -> None:
    """out = cache's rows at index, straight into out when both live on one device."""
    rows = index[cache.device]
    if cache.device == out.device and out.is_contiguous():
        torch.index_select(as_rows(cache), 0, rows, out=as_rows(out))
    else:
        out.copy_(select_rows(cache, rows), non_blocking=True)


def _send(
    gathered: torch.Tensor, host: torch.Tensor, stream: torch.cuda.Stream | None
) -> memoryview:
    """The chunk's bytes on the host: copied from the device and waited for (CUDA), or as is."""
    if stream is not None:
        host.copy_(gathered, non_blocking=True)
        stream.synchronize()
    return host.view(torch.uint8).numpy().data.cast("B")
