"""Reading leased KV blocks out of the pool for a pull, in kv_transfer's wire order (layer-major:
each layer's keys, then its values, each [blocks, block_size, kv_heads, head_dim]).

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

CHUNK_BYTES = 32 << 20


class KVExporter:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
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
        block_bytes = keys0[0].numel() * keys0.element_size()  # one block of one layer's keys
        stream = self._side_stream(device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            index = torch.tensor(block_ids, dtype=torch.long).to(device, non_blocking=True)
            layers = max(1, chunk_bytes // (2 * n * block_bytes))  # whole layers per chunk
            blocks = min(n, max(1, chunk_bytes // block_bytes))  # blocks per piece otherwise
            if 2 * n * block_bytes <= chunk_bytes:
                shape = (min(layers, len(self.kv_caches)), 2, n, *keys0.shape[1:])
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
        index: torch.Tensor,
        layers: int,
        shape: tuple[int, ...],
        stream: torch.cuda.Stream | None,
    ) -> Iterator[memoryview]:
        gathered, host = self._buffers(shape, stream)  # [layers, k/v, n, bs, H, D]
        for start in range(0, len(self.kv_caches), layers):
            group = self.kv_caches[start : start + layers]
            for i, (keys, values) in enumerate(group):
                torch.index_select(keys, 0, index, out=gathered[i, 0])
                torch.index_select(values, 0, index, out=gathered[i, 1])
            yield _send(gathered[: len(group)], host[: len(group)], stream)

    def _pieces(
        self, index: torch.Tensor, blocks: int, stream: torch.cuda.Stream | None
    ) -> Iterator[memoryview]:
        shape = (blocks, *self.kv_caches[0][0].shape[1:])
        gathered, host = self._buffers(shape, stream)  # [blocks, bs, H, D]
        for keys, values in self.kv_caches:
            for cache in (keys, values):
                for start in range(0, len(index), blocks):
                    part = index[start : start + blocks]
                    torch.index_select(cache, 0, part, out=gathered[: len(part)])
                    yield _send(gathered[: len(part)], host[: len(part)], stream)


def _send(
    gathered: torch.Tensor, host: torch.Tensor, stream: torch.cuda.Stream | None
) -> memoryview:
    """The chunk's bytes on the host: copied from the device and waited for (CUDA), or as is."""
    if stream is not None:
        host.copy_(gathered, non_blocking=True)
        stream.synchronize()
    return host.view(torch.uint8).numpy().data.cast("B")
