"""Hand-off bandwidth: KV pulls from a prefill worker, and a plain loopback TCP socket moving
the same bytes, for comparison."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import dataclass

import httpx

from phasefleet.api.contract import INTERNAL_TOKEN_HEADER, Metric

RECV_CHUNK = 1 << 20  # bytes per recv_into


@dataclass(frozen=True)
class Pull:
    num_tokens: int  # prompt tokens whose KV moved
    nbytes: int
    seconds: float  # GET sent to the last byte received

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def pull_kv(client: httpx.Client, prefill_url: str, token: str, prompt: list[int]) -> Pull:
    """Prefill `prompt` on the prefill worker, then time one GET /internal/kv pull of its KV
    into a preallocated buffer (as the decode worker does), then release the lease."""
    headers = {INTERNAL_TOKEN_HEADER: token}
    answer = client.post(
        f"{prefill_url}/internal/prefill",
        headers=headers,
        json={
            "request_id": f"bench-{uuid.uuid4().hex[:8]}",
            "prompt_token_ids": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=300,
    )
    answer.raise_for_status()
    kv = answer.json()["kv"]
    url = f"{prefill_url}/internal/kv/{kv['request_id']}"
    started = time.perf_counter()
    with client.stream("GET", url, headers=headers, timeout=60) as response:
        response.raise_for_status()
        buffer = bytearray(int(response.headers["content-length"]))
        received = 0
        for chunk in response.iter_raw(RECV_CHUNK):
            buffer[received : received + len(chunk)] = chunk
            received += len(chunk)
    seconds = time.perf_counter() - started
    client.delete(url, headers=headers, timeout=10)
    return Pull(kv["num_tokens"], received, seconds)


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

    def __sub__(self, other: HandoffTotals) -> HandoffTotals:
        return HandoffTotals(
            self.pulls - other.pulls, self.nbytes - other.nbytes, self.seconds - other.seconds
        )


async def handoff_totals(client: httpx.AsyncClient, decode_url: str) -> HandoffTotals:
    text = (await client.get(f"{decode_url}/metrics", timeout=10)).text
    return HandoffTotals(
        pulls=int(metric_sum(text, f"{Metric.KV_TRANSFER_SECONDS}_count")),
        nbytes=metric_sum(text, Metric.KV_TRANSFER_BYTES_TOTAL),
        seconds=metric_sum(text, f"{Metric.KV_TRANSFER_SECONDS}_sum"),
    )
