"""Hand-off bandwidth: a prompt's KV streamed from a prefill worker as the decode worker
receives it (what came after the first token, timed from it: the transfer the prefill did not
hide), and a plain loopback TCP socket moving the same bytes, for comparison."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import dataclass

import httpx

from phasefleet.api.contract import INTERNAL_TOKEN_HEADER, Metric
from phasefleet.server.kv_stream import StreamChunk, stream_prefill
from phasefleet.server.kv_wire import PREFILL_PATH, PrefillRequest

RECV_CHUNK = 1 << 20  # bytes per recv_into


@dataclass(frozen=True)
class Pull:
    nbytes: int  # all the KV the stream carried
    seconds: float  # the prefill request sent to the stream's last byte (prefill included)
    tail_bytes: int  # the KV that came after the first token
    tail_seconds: float  # the first token to the stream's last byte: the transfer alone

    @property
    def gbps(self) -> float:
        """The hand-off's own bandwidth: the KV after the first token over its time."""
        return self.tail_bytes / self.tail_seconds / 1e9


def stream_kv(prefill_url: str, token: str, prompt: list[int]) -> Pull:
    """Prefills `prompt` on the prefill worker and receives its KV as the decode worker does
    (the streamed hand-off: server/kv_stream.py), timing the whole stream and what came after
    the first token (all of it for a prompt prefilled in one step). The prefill worker lets
    the blocks go when the stream ends."""
    body = PrefillRequest(
        request_id=f"bench-{uuid.uuid4().hex[:8]}",
        prompt_token_ids=prompt,
        max_tokens=2,
        temperature=0,
        ignore_eos=True,
    )
    first_at: list[float] = []
    tail = [0]

    def on_chunk(chunk: StreamChunk) -> None:
        if first_at:
            tail[0] += len(chunk.payload)

    started = time.perf_counter()
    result = stream_prefill(
        f"{prefill_url}{PREFILL_PATH}",
        {INTERNAL_TOKEN_HEADER: token},
        body.model_dump_json().encode(),
        lambda _: None,
        lambda *_: first_at.append(time.perf_counter()),
        on_chunk,
        10.0,
        300.0,
        60.0,
    )
    ended = time.perf_counter()
    if result.failure is not None or result.end is None or not first_at:
        raise RuntimeError(f"the KV stream from {prefill_url} broke: {result.failure}")
    return Pull(result.nbytes, ended - started, tail[0], ended - first_at[0])


def socket_seconds(nbytes: int) -> float:
    """Seconds to move `nbytes` over one loopback TCP connection: sendall in a thread,
    recv_into a preallocated buffer here."""
    payload = bytes(nbytes)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as out:
                out.sendall(payload)

        sender = threading.Thread(target=send)
        started = time.perf_counter()
        sender.start()
        conn, _ = server.accept()
        with conn:
            buffer = bytearray(nbytes)
            view = memoryview(buffer)
            received = 0
            while received < nbytes:
                n = conn.recv_into(view[received:], min(RECV_CHUNK, nbytes - received))
                if n == 0:
                    raise RuntimeError(f"socket closed after {received} of {nbytes} bytes")
                received += n
        seconds = time.perf_counter() - started
        sender.join()
    return seconds


def metric_sum(text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True)
class HandoffTotals:
    pulls: int  # hand-offs the decode worker pulled
    nbytes: float
    seconds: float  # summed pull time, as the decode worker measured it
    remote: int  # prompts prefilled on the prefill worker
    local: int  # prompts the decode worker prefilled itself
    failures: int  # hand-offs that fell back to a local prefill or a recompute

    def __sub__(self, other: HandoffTotals) -> HandoffTotals:
        return HandoffTotals(
            self.pulls - other.pulls,
            self.nbytes - other.nbytes,
            self.seconds - other.seconds,
            self.remote - other.remote,
            self.local - other.local,
            self.failures - other.failures,
        )


async def handoff_totals(client: httpx.AsyncClient, decode_url: str) -> HandoffTotals:
    text = (await client.get(f"{decode_url}/metrics", timeout=10)).text
    prefills = {
        where: sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(Metric.PREFILLS_TOTAL) and f'where="{where}"' in line
        )
        for where in ("local", "remote")
    }
    return HandoffTotals(
        pulls=int(metric_sum(text, f"{Metric.KV_TRANSFER_SECONDS}_count")),
        nbytes=metric_sum(text, Metric.KV_TRANSFER_BYTES_TOTAL),
        seconds=metric_sum(text, f"{Metric.KV_TRANSFER_SECONDS}_sum"),
        remote=int(prefills["remote"]),
        local=int(prefills["local"]),
        failures=int(metric_sum(text, Metric.KV_TRANSFER_FAILURES_TOTAL)),
    )
