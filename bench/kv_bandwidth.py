"""Hand-off bandwidth: KV pulls from a prefill worker, and a plain loopback TCP socket moving
the same bytes, for comparison."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from phasefleet.api.contract import INTERNAL_TOKEN_HEADER, Metric

RECV_CHUNK = 1 << 20  # bytes per recv_into


@dataclass(frozen=True)
class Pull:
    nbytes: int
    seconds: float  # GET sent to the last byte received

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def lease_kv(client: httpx.Client, prefill_url: str, token: str, prompt: list[int]) -> str:
    """Prefills `prompt` on the prefill worker; the URL of its leased KV."""
    answer = client.post(
        f"{prefill_url}/internal/prefill",
        headers={INTERNAL_TOKEN_HEADER: token},
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
    return f"{prefill_url}/internal/kv/{answer.json()['kv']['request_id']}"


def pull_kv(client: httpx.Client, url: str, token: str) -> Pull:
    """Times one GET of leased KV with httpx into a preallocated buffer (as the decode worker
    does), then releases the lease."""
    headers = {INTERNAL_TOKEN_HEADER: token}
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
    return Pull(received, seconds)


def pull_kv_raw(client: httpx.Client, url: str, token: str) -> Pull:
    """The same GET over a bare socket (HTTP/1.1 written by hand, body read with recv_into):
    what the server side alone can send, without the client's HTTP library."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port)) as conn:
        started = time.perf_counter()
        conn.sendall(
            f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"{INTERNAL_TOKEN_HEADER}: {token}\r\nConnection: close\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            more = conn.recv(4096)
            if not more:
                raise RuntimeError(f"no answer from {url}")
            head += more
        head, body_start = head.split(b"\r\n\r\n", 1)
        fields = dict(
            line.split(": ", 1) for line in head.decode("latin-1").lower().split("\r\n")[1:]
        )
        nbytes = int(fields["content-length"])
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        view[: len(body_start)] = body_start
        received = len(body_start)
        while received < nbytes:
            n = conn.recv_into(view[received:], min(RECV_CHUNK, nbytes - received))
            if n == 0:
                raise RuntimeError(f"{url}: closed after {received} of {nbytes} bytes")
            received += n
        seconds = time.perf_counter() - started
    client.delete(url, headers={INTERNAL_TOKEN_HEADER: token}, timeout=10)
    return Pull(received, seconds)


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
