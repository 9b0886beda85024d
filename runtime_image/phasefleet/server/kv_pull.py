"""One KV pull: an HTTP/1.1 GET whose body the socket writes straight into the caller's buffer.

A general HTTP client parses the body in Python and copies each chunk it hands back; a pull is
tens to hundreds of MB of one known size, so here the body goes from the kernel into the
destination with `recv_into` and no copy in between (the benchmark measured 0.34 of a
loopback socket's bandwidth through httpx and 0.77 this way). Blocking: run it in a thread.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

HEADER_LIMIT = 64 * 1024  # bytes of status line and headers a prefill worker may send


class PullError(Exception):
    """The pull failed; `reason` is the failures metric's label (see handoff.HandoffFailed)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _status_and_length(head: bytes) -> tuple[int, int | None]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise PullError("pull_failed", f"not an HTTP status line: {lines[0][:80]!r}")
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length" and value.strip().isdigit():
            length = int(value.strip())
    return int(parts[1]), length


def get_into(url: str, headers: dict[str, str], buffer: memoryview, timeout: float) -> int:
    """GETs `url` (http only) into `buffer`, which must be exactly the body's size; returns the
    bytes received (less than the buffer when the sender hung up early). PullError when the
    answer is not a 200 of that size, or `timeout` seconds pass."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise PullError("pull_failed", f"expected an http:// URL, got {url!r}")
    port = parts.port or 80
    deadline = time.monotonic() + timeout
    lines = [f"GET {parts.path} HTTP/1.1", f"Host: {parts.hostname}:{port}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout) as sock:
            sock.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:
                data = sock.recv(65536)
                if not data:
                    raise PullError("pull_failed", "the connection closed before the headers")
                head += data
                if len(head) > HEADER_LIMIT:
                    raise PullError("pull_failed", "headers over 64 KiB")
            head, _, first = head.partition(b"\r\n\r\n")
            status, length = _status_and_length(head)
            if status == 404:
                raise PullError("lease_expired", "the prefill worker no longer holds it")
            if status != 200:
                raise PullError("pull_failed", f"status {status}")
            if length != len(buffer):
                raise PullError("pull_failed", f"body of {length} bytes, expected {len(buffer)}")
            if len(first) > len(buffer):
                raise PullError("pull_failed", f"more than {len(buffer)} bytes sent")
            buffer[: len(first)] = first
            received = len(first)
            while received < len(buffer):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PullError("pull_timeout", f"over {timeout}s")
                sock.settimeout(left)
                n = sock.recv_into(buffer[received:])
                if n == 0:
                    break
                received += n
            return received
    except TimeoutError:
        raise PullError("pull_timeout", f"over {timeout}s") from None
    except OSError as exc:
        raise PullError("pull_failed", repr(exc)) from None
